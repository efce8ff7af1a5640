//! Eviction policies: which unpinned ready blocks to free when the pool is full.
//!
//! The tier owns the mechanism (`READY(pins 0) -> EVICTING` by CAS, index removal, generation bump,
//! see `docs/design.md`); a policy only *proposes* victims. It is told about inserts, hits and
//! removals, and when the tier needs `n` slots it asks [`EvictionPolicy::select_victims`] for up to
//! `n` candidates among the slots the tier's `evictable` predicate accepts (ready, unpinned). A
//! candidate that got pinned in between is simply skipped by the tier's CAS, so a policy can never
//! cause a pinned or half-written block to be evicted.
//!
//! Policies keep per-slot state in atomics so `on_hit` (called on the query path) is lock-free.
//! `select_victims` is called by one thread at a time (the tier serialises eviction).

use crate::slot::SlotId;
use crate::sync::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Mutex, Ordering};
use std::fmt;
use std::str::FromStr;

/// A victim-selection policy. See the module docs for the contract.
pub trait EvictionPolicy: Send + Sync {
    /// Short name for reports (`lru`, `clock`).
    fn name(&self) -> &'static str;
    /// A block became ready in `slot` (its save committed); `info` carries its key hash and, when
    /// the saver knew it, its depth in the prompt.
    fn on_insert(&self, slot: SlotId, info: InsertInfo);
    /// The block in `slot` was hit by a query or re-saved (refresh recency).
    fn on_hit(&self, slot: SlotId);
    /// The block in `slot` was evicted or dropped.
    fn on_remove(&self, slot: SlotId);
    /// Appends up to `n` victim candidates to `out`, best victim first, choosing only slots for
    /// which `evictable` returns true.
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>);
    /// Admission: may a missing block with `info` take a slot? Called on the save path
    /// ([`crate::tier::Fit::Prefix`] saves only) once per missing key, in prompt order, before any
    /// slot is taken; from the first refusal on, no key of the batch is saved (a prefix hit cannot
    /// reach past a gap), but later keys are still shown so the policy can count them. Must be
    /// lock-free. The default admits everything.
    fn admit(&self, info: InsertInfo) -> bool {
        let _ = info;
        true
    }
}

/// What a policy learns about a block when it becomes ready.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct InsertInfo {
    /// [`crate::ContentKey::hash64`] of the block's key (lets a policy remember keys it evicted).
    pub key_hash: u64,
    /// The block's position in its prompt (0 = the first page), if the saver passed
    /// [`crate::tier::SaveHint::prefix_depth`]. A prefix hit on page `d` needs pages `0..d` resident.
    pub depth: Option<u32>,
}

/// The built-in policies.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum PolicyKind {
    /// Least recently used, exact: every insert and hit takes a tick from one global counter, and
    /// victims are the unpinned ready blocks with the smallest ticks.
    Lru,
    /// CLOCK (second chance) over the slot array: a hit sets a reference bit; the hand clears set
    /// bits and evicts the first unpinned ready slot whose bit is clear.
    Clock,
    /// SIEVE (Zhang et al., NSDI'24): one insertion-ordered queue and a visited bit; the hand walks
    /// from the oldest block towards the newest, clearing visited bits, and evicts the first
    /// unvisited block in place (survivors are not moved).
    Sieve,
    /// S3-FIFO (Yang et al., SOSP'23): new blocks enter a small FIFO (10% of the pool); a block hit
    /// while there moves to the main FIFO, the others are evicted and their key hashes kept in a
    /// ghost table; a block whose key is in the ghost enters the main FIFO directly. The main FIFO
    /// reinserts blocks with a non-zero 2-bit frequency (decrementing it).
    S3Fifo,
    /// Prefix-aware frequency-weighted recency: the score of a block is its last-touch tick plus
    /// `8 x capacity` ticks per reference its key has had (a 4-bit count-min history that survives
    /// eviction and is halved every `64 x capacity` references), minus twice its prompt depth, so
    /// blocks of keys seen again (continuing conversations, shared prefixes) outlive blocks seen
    /// once and a chain loses its tail before its head. Victims are the lowest scores.
    /// `PolicyKind::default()` (the best hit ratio of the built-in policies on the Mooncake
    /// conversation trace at 8-64 GiB GLM-5.2 pools, `kvtier simulate`, docs/benchmarks.md); note
    /// that [`crate::TierConfig::new`] and `kvtier replay` default to [`PolicyKind::Lru`].
    #[default]
    PrefixLfu,
    /// [`PolicyKind::PrefixLfu`] with a TinyLFU-style doorkeeper on admission: a missing block whose
    /// key has no reference in the policy's history (never seen, or sharing no hash cell with a
    /// key seen before) is not saved, only counted, so it is admitted when it is seen again. Ageing
    /// rounds the halved counters up here, so a key once seen is never forgotten; as the history
    /// fills, more first sightings collide with old keys and are admitted; the rest of that save is dropped with it
    /// (a chain with a gap is worth nothing past the gap). Blocks seen once are the least likely
    /// to be reused (on the Mooncake conversation trace a first turn is continued 31% of the
    /// time, a later one 42-75%), so they no longer push out blocks with a history. No
    /// parameters beyond PrefixLfu's.
    PrefixTinyLfu,
}

impl PolicyKind {
    /// All built-in policies, for `--policy` help and comparisons.
    pub const ALL: &'static [PolicyKind] = &[
        PolicyKind::Lru,
        PolicyKind::Clock,
        PolicyKind::Sieve,
        PolicyKind::S3Fifo,
        PolicyKind::PrefixLfu,
        PolicyKind::PrefixTinyLfu,
    ];

    /// A policy instance for a pool of `capacity` slots.
    pub fn build(self, capacity: u32) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::Lru => Box::new(Lru::new(capacity)),
            PolicyKind::Clock => Box::new(Clock::new(capacity)),
            PolicyKind::Sieve => Box::new(Sieve::new(capacity)),
            PolicyKind::S3Fifo => Box::new(S3Fifo::new(capacity)),
            PolicyKind::PrefixLfu => Box::new(PrefixLfu::new(capacity)),
            PolicyKind::PrefixTinyLfu => Box::new(PrefixLfu::with_doorkeeper(capacity)),
        }
    }

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Clock => "clock",
            PolicyKind::Sieve => "sieve",
            PolicyKind::S3Fifo => "s3fifo",
            PolicyKind::PrefixLfu => "prefix-lfu",
            PolicyKind::PrefixTinyLfu => "prefix-tinylfu",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        PolicyKind::ALL.iter().copied().find(|p| p.name() == s).ok_or_else(|| {
            let known: Vec<&str> = PolicyKind::ALL.iter().map(|p| p.name()).collect();
            format!("unknown policy `{s}` (known: {})", known.join(", "))
        })
    }
}

/// Exact LRU with lock-free recency updates (see [`PolicyKind::Lru`]). Selection scans the slot
/// array once per eviction batch: O(capacity), about 10 us for 10,000 slots, paid on the save path
/// only when the pool is full.
pub struct Lru {
    ticks: Box<[AtomicU64]>,
    clock: AtomicU64,
}

impl Lru {
    /// An LRU for `capacity` slots.
    pub fn new(capacity: u32) -> Self {
        Lru { ticks: (0..capacity).map(|_| AtomicU64::new(0)).collect(), clock: AtomicU64::new(1) }
    }
    fn touch(&self, slot: SlotId) {
        let t = self.clock.fetch_add(1, Ordering::Relaxed);
        self.ticks[slot.index()].store(t, Ordering::Relaxed);
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn on_insert(&self, slot: SlotId, _info: InsertInfo) {
        self.touch(slot)
    }
    fn on_hit(&self, slot: SlotId) {
        self.touch(slot)
    }
    fn on_remove(&self, _slot: SlotId) {}
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) {
        if n == 0 {
            return;
        }
        let mut cands: Vec<(u64, u32)> = (0..self.ticks.len() as u32)
            .filter(|&s| evictable(SlotId(s)))
            .map(|s| (self.ticks[s as usize].load(Ordering::Relaxed), s))
            .collect();
        if cands.len() > n {
            cands.select_nth_unstable(n - 1);
            cands.truncate(n);
        }
        cands.sort_unstable();
        out.extend(cands.into_iter().map(|(_, s)| SlotId(s)));
    }
}

/// CLOCK / second chance (see [`PolicyKind::Clock`]).
pub struct Clock {
    referenced: Box<[AtomicU8]>,
    hand: AtomicUsize,
}

impl Clock {
    /// A CLOCK for `capacity` slots.
    pub fn new(capacity: u32) -> Self {
        Clock { referenced: (0..capacity).map(|_| AtomicU8::new(0)).collect(), hand: AtomicUsize::new(0) }
    }
}

impl EvictionPolicy for Clock {
    fn name(&self) -> &'static str {
        "clock"
    }
    fn on_insert(&self, slot: SlotId, _info: InsertInfo) {
        self.referenced[slot.index()].store(0, Ordering::Relaxed);
    }
    fn on_hit(&self, slot: SlotId) {
        self.referenced[slot.index()].store(1, Ordering::Relaxed);
    }
    fn on_remove(&self, slot: SlotId) {
        self.referenced[slot.index()].store(0, Ordering::Relaxed);
    }
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) {
        let cap = self.referenced.len();
        if cap == 0 || n == 0 {
            return;
        }
        let mut hand = self.hand.load(Ordering::Relaxed) % cap;
        let start = out.len();
        // Two full sweeps: the first may only clear reference bits.
        for _ in 0..2 * cap {
            let s = SlotId(hand as u32);
            hand = (hand + 1) % cap;
            if !evictable(s) {
                continue;
            }
            if self.referenced[s.index()].swap(0, Ordering::Relaxed) != 0 {
                continue;
            }
            out.push(s);
            if out.len() - start == n {
                break;
            }
        }
        self.hand.store(hand, Ordering::Relaxed);
    }
}

/// `u32::MAX`: no slot (end of a queue).
const NIL: u32 = u32::MAX;

/// A lock-free multi-producer log of slots that became ready, drained in order by the (single)
/// victim selector. Entry `p` lives at `ring[p % len]` as `(p as u32) << 32 | slot`; the consumer
/// takes entry `head` only once its position tag matches, so a producer that has claimed a
/// position but not yet written it simply ends the drain early.
///
/// Bound: an entry stays unconsumed only while its slot is ready and unknown to the selector, so
/// such a slot cannot be evicted and inserted again: at most `capacity` entries are ever pending,
/// and `len = 2 x capacity` (rounded up to a power of two) positions never overwrite one.
struct InsertLog {
    ring: Box<[AtomicU64]>,
    mask: u64,
    tail: AtomicU64,
}

impl InsertLog {
    fn new(capacity: u32) -> Self {
        let len = (2 * capacity.max(1) as u64).next_power_of_two();
        // Initial tags are one lap behind every position, so no entry looks written.
        let ring = (0..len).map(|i| AtomicU64::new((i.wrapping_sub(len) as u32 as u64) << 32)).collect();
        InsertLog { ring, mask: len - 1, tail: AtomicU64::new(0) }
    }

    fn push(&self, slot: SlotId) {
        let p = self.tail.fetch_add(1, Ordering::Relaxed);
        // Release: the per-slot state written before the push is visible to the drain.
        self.ring[(p & self.mask) as usize].store(((p as u32 as u64) << 32) | slot.0 as u64, Ordering::Release);
    }

    /// Calls `f` for every entry from `*head` on that has been written, advancing `*head`.
    fn drain(&self, head: &mut u64, mut f: impl FnMut(u32)) {
        loop {
            let e = self.ring[(*head & self.mask) as usize].load(Ordering::Acquire);
            if (e >> 32) as u32 != *head as u32 {
                return;
            }
            f(e as u32);
            *head += 1;
        }
    }
}

/// Which slots a queue-based policy believes resident: a stamp per slot (insert sequence number,
/// 0 = not resident) plus the insert log. A proposed victim whose eviction the tier did not carry
/// out (it was pinned in between, so `on_remove` never came) still has its stamp at the next
/// selection and is put back in a queue.
struct Membership {
    stamp: Box<[AtomicU64]>,
    seq: AtomicU64,
    log: InsertLog,
}

impl Membership {
    fn new(capacity: u32) -> Self {
        Membership {
            stamp: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            seq: AtomicU64::new(1),
            log: InsertLog::new(capacity),
        }
    }
    fn insert(&self, slot: SlotId) {
        let st = self.seq.fetch_add(1, Ordering::Relaxed);
        self.stamp[slot.index()].store(st, Ordering::Relaxed);
        self.log.push(slot);
    }
    fn remove(&self, slot: SlotId) {
        self.stamp[slot.index()].store(0, Ordering::Relaxed);
    }
    fn stamp(&self, slot: u32) -> u64 {
        self.stamp[slot as usize].load(Ordering::Relaxed)
    }
    /// The proposals of the last selection that are still resident (their eviction was refused).
    fn refused(&self, proposed: &mut Vec<(u32, u64)>, mut f: impl FnMut(u32)) {
        for (s, st) in proposed.drain(..) {
            if self.stamp(s) == st {
                f(s);
            }
        }
    }
}

/// An intrusive doubly linked FIFO over slot ids (selector-private).
struct Fifo {
    newer: Vec<u32>,
    older: Vec<u32>,
    member: Vec<bool>,
    newest: u32,
    oldest: u32,
    len: usize,
}

impl Fifo {
    fn new(capacity: u32) -> Self {
        let c = capacity as usize;
        Fifo { newer: vec![NIL; c], older: vec![NIL; c], member: vec![false; c], newest: NIL, oldest: NIL, len: 0 }
    }
    fn push_newest(&mut self, s: u32) {
        let i = s as usize;
        debug_assert!(!self.member[i], "slot {s} queued twice");
        self.older[i] = self.newest;
        self.newer[i] = NIL;
        if self.newest != NIL {
            self.newer[self.newest as usize] = s;
        } else {
            self.oldest = s;
        }
        self.newest = s;
        self.member[i] = true;
        self.len += 1;
    }
    fn unlink(&mut self, s: u32) {
        let i = s as usize;
        debug_assert!(self.member[i], "slot {s} not queued");
        let (o, n) = (self.older[i], self.newer[i]);
        if o != NIL {
            self.newer[o as usize] = n;
        } else {
            self.oldest = n;
        }
        if n != NIL {
            self.older[n as usize] = o;
        } else {
            self.newest = o;
        }
        self.member[i] = false;
        self.len -= 1;
    }
    fn pop_oldest(&mut self) -> Option<u32> {
        let s = self.oldest;
        (s != NIL).then(|| {
            self.unlink(s);
            s
        })
    }
}

/// SIEVE (see [`PolicyKind::Sieve`]). Hits set a per-slot visited byte (lock-free); inserts go
/// through the lock-free [`InsertLog`]; the queue and the hand are private to the selector.
pub struct Sieve {
    visited: Box<[AtomicU8]>,
    members: Membership,
    state: Mutex<SieveState>,
}

struct SieveState {
    queue: Fifo,
    hand: u32,
    log_head: u64,
    proposed: Vec<(u32, u64)>,
}

impl Sieve {
    /// A SIEVE for `capacity` slots.
    pub fn new(capacity: u32) -> Self {
        Sieve {
            visited: (0..capacity).map(|_| AtomicU8::new(0)).collect(),
            members: Membership::new(capacity),
            state: Mutex::new(SieveState { queue: Fifo::new(capacity), hand: NIL, log_head: 0, proposed: Vec::new() }),
        }
    }
}

impl EvictionPolicy for Sieve {
    fn name(&self) -> &'static str {
        "sieve"
    }
    fn on_insert(&self, slot: SlotId, _info: InsertInfo) {
        self.visited[slot.index()].store(0, Ordering::Relaxed);
        self.members.insert(slot);
    }
    fn on_hit(&self, slot: SlotId) {
        let v = &self.visited[slot.index()];
        if v.load(Ordering::Relaxed) == 0 {
            v.store(1, Ordering::Relaxed);
        }
    }
    fn on_remove(&self, slot: SlotId) {
        self.members.remove(slot);
    }
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) {
        let mut guard = self.state.lock().expect("sieve state");
        let st = &mut *guard;
        let mut proposed = std::mem::take(&mut st.proposed);
        self.members.refused(&mut proposed, |s| st.queue.push_newest(s));
        self.members.log.drain(&mut st.log_head, |s| st.queue.push_newest(s));
        let mut found = 0;
        // Every step either evicts, clears a visited byte or passes a pinned slot: two laps bound it.
        let mut steps = 2 * st.queue.len + 1;
        while found < n && st.queue.len > 0 && steps > 0 {
            steps -= 1;
            let s = if st.hand == NIL || !st.queue.member[st.hand as usize] { st.queue.oldest } else { st.hand };
            st.hand = st.queue.newer[s as usize];
            if !evictable(SlotId(s)) || self.visited[s as usize].swap(0, Ordering::Relaxed) != 0 {
                continue;
            }
            st.queue.unlink(s);
            proposed.push((s, self.members.stamp(s)));
            out.push(SlotId(s));
            found += 1;
        }
        st.proposed = proposed;
    }
}

/// S3-FIFO (see [`PolicyKind::S3Fifo`]). Hits bump a 2-bit per-slot frequency (lock-free);
/// queues and the ghost table are private to the selector.
pub struct S3Fifo {
    freq: Box<[AtomicU8]>,
    key_hash: Box<[AtomicU64]>,
    members: Membership,
    small_target: usize,
    state: Mutex<S3State>,
}

struct S3State {
    small: Fifo,
    main: Fifo,
    /// Direct-mapped ghost of evicted key hashes (0 = empty), about `GHOST_FACTOR x capacity`.
    ghost: Vec<u64>,
    log_head: u64,
    proposed: Vec<(u32, u64)>,
}

impl S3Fifo {
    /// Ghost entries per slot (rounded up to a power of two); measured on the conversation trace.
    const GHOST_FACTOR: u64 = 4;

    /// An S3-FIFO for `capacity` slots (small FIFO: 10% of them, at least 1).
    pub fn new(capacity: u32) -> Self {
        let ghost = (Self::GHOST_FACTOR * capacity.max(1) as u64).next_power_of_two() as usize;
        S3Fifo {
            freq: (0..capacity).map(|_| AtomicU8::new(0)).collect(),
            key_hash: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            members: Membership::new(capacity),
            small_target: (capacity as usize / 10).max(1),
            state: Mutex::new(S3State {
                small: Fifo::new(capacity),
                main: Fifo::new(capacity),
                ghost: vec![0; ghost],
                log_head: 0,
                proposed: Vec::new(),
            }),
        }
    }

    fn ghost_tag(&self, s: u32) -> u64 {
        self.key_hash[s as usize].load(Ordering::Relaxed).max(1)
    }
}

impl EvictionPolicy for S3Fifo {
    fn name(&self) -> &'static str {
        "s3fifo"
    }
    fn on_insert(&self, slot: SlotId, info: InsertInfo) {
        self.freq[slot.index()].store(0, Ordering::Relaxed);
        self.key_hash[slot.index()].store(info.key_hash, Ordering::Relaxed);
        self.members.insert(slot);
    }
    fn on_hit(&self, slot: SlotId) {
        // Racy saturating increment: a lost update only under-counts a concurrent hit.
        let f = &self.freq[slot.index()];
        let v = f.load(Ordering::Relaxed);
        if v < 3 {
            f.store(v + 1, Ordering::Relaxed);
        }
    }
    fn on_remove(&self, slot: SlotId) {
        self.members.remove(slot);
    }
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) {
        let mut guard = self.state.lock().expect("s3fifo state");
        let st = &mut *guard;
        let mask = st.ghost.len() - 1;
        let mut proposed = std::mem::take(&mut st.proposed);
        self.members.refused(&mut proposed, |s| st.main.push_newest(s));
        self.members.log.drain(&mut st.log_head, |s| {
            let tag = self.ghost_tag(s);
            let g = &mut st.ghost[tag as usize & mask];
            if *g == tag {
                *g = 0;
                st.main.push_newest(s);
            } else {
                st.small.push_newest(s);
            }
        });
        let mut found = 0;
        // Each step evicts, promotes, or reinserts with a lower frequency (at most 3 per block), or
        // passes a pinned block: this bounds the loop when everything is pinned.
        let mut steps = 5 * (st.small.len + st.main.len) + 1;
        while found < n && steps > 0 {
            steps -= 1;
            let from_small = st.small.len > 0 && (st.small.len >= self.small_target || st.main.len == 0);
            let s = if from_small { st.small.pop_oldest() } else { st.main.pop_oldest() };
            let Some(s) = s else { break };
            let f = &self.freq[s as usize];
            if !evictable(SlotId(s)) {
                if from_small {
                    st.small.push_newest(s)
                } else {
                    st.main.push_newest(s)
                }
                continue;
            }
            let v = f.load(Ordering::Relaxed);
            if from_small && v > 0 {
                f.store(0, Ordering::Relaxed);
                st.main.push_newest(s);
                continue;
            }
            if !from_small && v > 0 {
                f.store(v - 1, Ordering::Relaxed);
                st.main.push_newest(s);
                continue;
            }
            if from_small {
                let tag = self.ghost_tag(s);
                st.ghost[tag as usize & mask] = tag;
            }
            proposed.push((s, self.members.stamp(s)));
            out.push(SlotId(s));
            found += 1;
        }
        st.proposed = proposed;
    }
}

/// Prefix-aware frequency-weighted recency (see [`PolicyKind::PrefixLfu`]). Inserts and hits take
/// a tick (one `fetch_add`, as LRU) and bump the key's count in a count-min history (two 4-bit
/// counters per key in a byte table of `256 x capacity` entries, conservative update); all
/// lock-free. Selection scans the slot array once per batch, as [`Lru`]. With the doorkeeper
/// ([`PrefixLfu::with_doorkeeper`], [`PolicyKind::PrefixTinyLfu`]) admission reads the key's two
/// history counters and, for a refused key, bumps them: also lock-free.
pub struct PrefixLfu {
    ticks: Box<[AtomicU64]>,
    depth: Box<[AtomicU32]>,
    key_hash: Box<[AtomicU64]>,
    /// The key's history count as of its last insert or hit (so selection reads no history).
    count: Box<[AtomicU8]>,
    clock: AtomicU64,
    history: Box<[AtomicU8]>,
    history_mask: u64,
    /// References counted since the history was last halved.
    refs: AtomicU64,
    age_period: u64,
    /// Ticks one reference of history is worth.
    weight: u64,
    /// Refuse keys without history ([`PolicyKind::PrefixTinyLfu`]).
    doorkeeper: bool,
}

impl PrefixLfu {
    /// Largest count kept per key (4 bits).
    const MAX_COUNT: u8 = 15;
    /// History bytes per slot. The history must tell apart the keys of many more blocks than the
    /// pool holds (the conversation trace has 1.46 M distinct pages): at 16 per slot collisions
    /// cost a third of the hits (0.065 against 0.091 at 9,952 slots), 256 per slot is 2.5 MiB for
    /// a 32 GiB GLM-5.2 pool.
    const HISTORY_PER_SLOT: u64 = 256;

    /// A prefix-aware LFU for `capacity` slots.
    pub fn new(capacity: u32) -> Self {
        let c = capacity.max(1) as u64;
        let hist = (Self::HISTORY_PER_SLOT * c).next_power_of_two();
        PrefixLfu {
            ticks: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            depth: (0..capacity).map(|_| AtomicU32::new(0)).collect(),
            key_hash: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            count: (0..capacity).map(|_| AtomicU8::new(0)).collect(),
            clock: AtomicU64::new(1),
            history: (0..hist).map(|_| AtomicU8::new(0)).collect(),
            history_mask: hist - 1,
            refs: AtomicU64::new(0),
            age_period: 64 * c,
            weight: 8 * c,
            doorkeeper: false,
        }
    }

    /// A prefix-aware LFU for `capacity` slots that admits only keys with a history reference
    /// (see [`PolicyKind::PrefixTinyLfu`]).
    pub fn with_doorkeeper(capacity: u32) -> Self {
        PrefixLfu { doorkeeper: true, ..Self::new(capacity) }
    }

    fn cells(&self, h: u64) -> [usize; 2] {
        [(h & self.history_mask) as usize, (h.rotate_right(32) & self.history_mask) as usize]
    }

    /// The key's reference count (the smaller of its two counters).
    fn count(&self, h: u64) -> u8 {
        self.cells(h).iter().map(|&i| self.history[i].load(Ordering::Relaxed)).min().unwrap_or(0)
    }

    /// Counts one reference of key hash `h` (conservative update: only the counters at the
    /// minimum grow; racy increments may be lost, which only under-counts).
    /// Returns the key's new count.
    fn bump(&self, h: u64) -> u8 {
        let m = self.count(h);
        self.refs.fetch_add(1, Ordering::Relaxed);
        if m >= Self::MAX_COUNT {
            return m;
        }
        for i in self.cells(h) {
            let c = &self.history[i];
            if c.load(Ordering::Relaxed) == m {
                c.store(m + 1, Ordering::Relaxed);
            }
        }
        m + 1
    }

    fn touch(&self, slot: SlotId) {
        let t = self.clock.fetch_add(1, Ordering::Relaxed);
        self.ticks[slot.index()].store(t, Ordering::Relaxed);
    }

    /// The eviction score: lower goes first.
    fn score(&self, s: usize) -> i64 {
        let t = self.ticks[s].load(Ordering::Relaxed) as i64;
        let c = self.count[s].load(Ordering::Relaxed) as i64;
        t + self.weight as i64 * c - 2 * self.depth[s].load(Ordering::Relaxed) as i64
    }
}

impl EvictionPolicy for PrefixLfu {
    fn name(&self) -> &'static str {
        if self.doorkeeper {
            "prefix-tinylfu"
        } else {
            "prefix-lfu"
        }
    }
    fn admit(&self, info: InsertInfo) -> bool {
        if !self.doorkeeper || self.count(info.key_hash) > 0 {
            return true;
        }
        // First sighting: remember it (so the next one is admitted) but do not take a slot.
        self.bump(info.key_hash);
        false
    }
    fn on_insert(&self, slot: SlotId, info: InsertInfo) {
        self.key_hash[slot.index()].store(info.key_hash, Ordering::Relaxed);
        self.depth[slot.index()].store(info.depth.unwrap_or(0), Ordering::Relaxed);
        self.count[slot.index()].store(self.bump(info.key_hash), Ordering::Relaxed);
        self.touch(slot);
    }
    fn on_hit(&self, slot: SlotId) {
        let c = self.bump(self.key_hash[slot.index()].load(Ordering::Relaxed));
        self.count[slot.index()].store(c, Ordering::Relaxed);
        self.touch(slot);
    }
    fn on_remove(&self, _slot: SlotId) {}
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) {
        if n == 0 {
            return;
        }
        if self.refs.load(Ordering::Relaxed) >= self.age_period {
            // Ageing (one selector at a time): halve every counter so old popularity fades.
            self.refs.store(0, Ordering::Relaxed);
            // With the doorkeeper, halving rounds up: a key seen once stays seen (else a first
            // sighting just before an ageing would be refused again at its second).
            let up = self.doorkeeper as u8;
            for c in self.history.iter() {
                let v = c.load(Ordering::Relaxed);
                c.store(v / 2 + (v & up), Ordering::Relaxed);
            }
        }
        let mut cands: Vec<(i64, u32)> = (0..self.ticks.len() as u32)
            .filter(|&s| evictable(SlotId(s)))
            .map(|s| (self.score(s as usize), s))
            .collect();
        if cands.len() > n {
            cands.select_nth_unstable(n - 1);
            cands.truncate(n);
        }
        cands.sort_unstable();
        out.extend(cands.into_iter().map(|(_, s)| SlotId(s)));
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn lru_picks_oldest_evictable_in_order() {
        let p = Lru::new(4);
        for s in [2, 0, 3, 1] {
            p.on_insert(SlotId(s), InsertInfo::default());
        }
        p.on_hit(SlotId(2));
        let mut out = vec![];
        p.select_victims(2, &|s| s != SlotId(0), &mut out);
        assert_eq!(out, vec![SlotId(3), SlotId(1)]);
        out.clear();
        p.select_victims(10, &|_| true, &mut out);
        assert_eq!(out, vec![SlotId(0), SlotId(3), SlotId(1), SlotId(2)]);
    }

    #[test]
    fn clock_gives_second_chance() {
        let p = Clock::new(3);
        for s in 0..3 {
            p.on_insert(SlotId(s), InsertInfo::default());
        }
        p.on_hit(SlotId(0));
        let mut out = vec![];
        p.select_victims(1, &|_| true, &mut out);
        assert_eq!(out, vec![SlotId(1)]);
        out.clear();
        p.select_victims(2, &|s| s != SlotId(2), &mut out);
        assert_eq!(out, vec![SlotId(0), SlotId(1)], "slot 0's bit was cleared by the first sweep");
    }

    fn info(key_hash: u64, depth: Option<u32>) -> InsertInfo {
        InsertInfo { key_hash, depth }
    }

    /// What the tier does with a proposal: evict it (`on_remove`).
    fn select_and_evict(p: &dyn EvictionPolicy, n: usize, evictable: &dyn Fn(SlotId) -> bool) -> Vec<SlotId> {
        let mut out = vec![];
        p.select_victims(n, evictable, &mut out);
        for &s in &out {
            p.on_remove(s);
        }
        out
    }

    #[test]
    fn sieve_evicts_unvisited_in_place_and_keeps_its_hand() {
        let p = Sieve::new(4);
        for s in 0..4 {
            p.on_insert(SlotId(s), info(s as u64, None));
        }
        p.on_hit(SlotId(0));
        p.on_hit(SlotId(2));
        // Hand at the oldest (0): visited, cleared; 1 is evicted.
        assert_eq!(select_and_evict(&p, 1, &|_| true), vec![SlotId(1)]);
        // The hand continues at 2 (visited, cleared), evicts 3, wraps to 0 (cleared before).
        assert_eq!(select_and_evict(&p, 2, &|_| true), vec![SlotId(3), SlotId(0)]);
        assert_eq!(select_and_evict(&p, 5, &|_| true), vec![SlotId(2)]);
    }

    #[test]
    fn sieve_requeues_a_refused_proposal() {
        let p = Sieve::new(3);
        for s in 0..3 {
            p.on_insert(SlotId(s), info(s as u64, None));
        }
        let mut out = vec![];
        p.select_victims(1, &|_| true, &mut out);
        assert_eq!(out, vec![SlotId(0)]);
        // The tier's CAS refused slot 0 (no on_remove): it is queued again as the newest.
        assert_eq!(select_and_evict(&p, 3, &|_| true), vec![SlotId(1), SlotId(2), SlotId(0)]);
    }

    #[test]
    fn s3fifo_promotes_hit_blocks_and_admits_ghosts_to_main() {
        let p = S3Fifo::new(10); // small FIFO target: 1 slot
        for s in 0..5 {
            p.on_insert(SlotId(s), info(100 + s as u64, None));
        }
        p.on_hit(SlotId(1));
        assert_eq!(select_and_evict(&p, 1, &|_| true), vec![SlotId(0)], "oldest unhit small block");
        assert_eq!(select_and_evict(&p, 1, &|_| true), vec![SlotId(2)], "slot 1 was hit: moved to main");
        // Key 100 (evicted from slot 0) is in the ghost: it enters main directly.
        p.on_insert(SlotId(0), info(100, None));
        assert_eq!(select_and_evict(&p, 2, &|_| true), vec![SlotId(3), SlotId(4)]);
        // Small is empty: main in FIFO order, slot 1 (promoted first), then slot 0.
        assert_eq!(select_and_evict(&p, 2, &|_| true), vec![SlotId(1), SlotId(0)]);
    }

    #[test]
    fn s3fifo_main_reinserts_by_frequency() {
        let p = S3Fifo::new(10);
        for s in 0..3 {
            p.on_insert(SlotId(s), info(s as u64, None));
            p.on_hit(SlotId(s));
        }
        // Drain small into main (all were hit), then hit slot 0 twice more in main.
        assert_eq!(select_and_evict(&p, 0, &|_| true), vec![]);
        let mut out = vec![];
        p.select_victims(1, &|_| true, &mut out);
        assert_eq!(out, vec![SlotId(0)], "promoted with frequency reset: slot 0 is main's oldest");
        p.on_remove(SlotId(0));
        p.on_hit(SlotId(1));
        assert_eq!(select_and_evict(&p, 2, &|_| true), vec![SlotId(2), SlotId(1)]);
    }

    #[test]
    fn prefix_lfu_drops_a_chain_tail_first_and_keeps_keys_seen_again() {
        let p = PrefixLfu::new(4);
        for s in 0..4 {
            p.on_insert(SlotId(s), info(10 + s as u64, Some(s)));
        }
        assert_eq!(select_and_evict(&p, 2, &|_| true), vec![SlotId(3), SlotId(2)]);

        let p = PrefixLfu::new(4);
        p.on_insert(SlotId(0), info(1, None));
        p.on_insert(SlotId(1), info(2, None));
        p.on_remove(SlotId(0));
        p.on_insert(SlotId(0), info(1, None)); // key 1 again: its history says 2 references
        p.on_insert(SlotId(2), info(3, None));
        assert_eq!(select_and_evict(&p, 3, &|s| s.0 < 3), vec![SlotId(1), SlotId(2), SlotId(0)]);
    }

    #[test]
    fn prefix_tinylfu_admits_a_key_on_its_second_sighting_and_ranks_by_history() {
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

    #[test]
    fn only_prefix_tinylfu_refuses_admission() {
        for &kind in PolicyKind::ALL {
            let p = kind.build(8);
            assert_eq!(p.admit(info(42, Some(3))), kind != PolicyKind::PrefixTinyLfu, "{kind}");
        }
    }

    #[test]
    fn no_policy_proposes_a_non_evictable_slot() {
        let cap = 64u32;
        for &kind in PolicyKind::ALL {
            let p = kind.build(cap);
            let mut x = 0x2545_f491_4f6c_dd1du64;
            let mut rnd = move |m: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % m
            };
            let mut resident = vec![false; cap as usize];
            for round in 0..2000u64 {
                let s = rnd(cap as u64) as u32;
                if !resident[s as usize] {
                    p.on_insert(SlotId(s), info(rnd(200), Some(rnd(40) as u32)));
                    resident[s as usize] = true;
                } else {
                    p.on_hit(SlotId(s));
                }
                if round % 7 == 0 {
                    let pinned = rnd(u64::MAX);
                    let ok = |t: SlotId| resident[t.index()] && (pinned >> t.0) & 1 == 0;
                    let n = rnd(6) as usize;
                    let mut out = vec![];
                    p.select_victims(n, &ok, &mut out);
                    assert!(out.len() <= n, "{kind}: {} > {n}", out.len());
                    let mut seen = std::collections::HashSet::new();
                    for &v in &out {
                        assert!(ok(v), "{kind} proposed slot {} which is not evictable", v.0);
                        assert!(seen.insert(v), "{kind} proposed slot {} twice", v.0);
                    }
                    // The tier evicts every other proposal (its CAS refuses the rest).
                    for (i, &v) in out.iter().enumerate() {
                        if i % 2 == 0 {
                            p.on_remove(v);
                            resident[v.index()] = false;
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn policy_names_parse() {
        for p in PolicyKind::ALL {
            assert_eq!(p.name().parse::<PolicyKind>(), Ok(*p));
        }
        assert!("fifo".parse::<PolicyKind>().is_err());
    }
}

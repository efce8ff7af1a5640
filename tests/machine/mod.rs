//! A state machine over a real [`HostTier`] checked step by step against a small sequential
//! reference model. Shared by the proptest suite (`tests/state_machine.rs`) and the `tier_ops` fuzz
//! target (`fuzz/fuzz_targets/tier_ops.rs`, which includes this file by path).
//!
//! The tier has two ranks:
//! - rank A: a *controlled* backend whose every copy completes only when the machine says so (in
//!   submission order, with success or an injected failure), so saves stay `WRITING` and restores
//!   keep their guard pins across later steps;
//! - rank B: the plain host backend; its saves and restores are waited for within the step.
//!
//! Pages `0..KEYS` of both ranks' arenas hold the bytes of keys `0..KEYS` (a save of key `i` reads
//! page `i`); restores write pages `KEYS..KEYS + MAX_SPAN`.
//!
//! The machine runs with any eviction policy ([`PolicyKind::ALL`]). The model predicts every
//! observable: each save's ticket or error, each query's lease, restore errors, the whole
//! [`TierStats`], and how many blocks each save or eviction evicts. *Which* blocks are evicted is the
//! policy's choice: for LRU the model predicts them exactly; for every other policy it checks that
//! they were among the unpinned ready blocks (never a pinned or in-flight one) and follows the tier.
//! Liveness is checked at every save: a save is refused only when the model says that the free plus
//! unpinned ready blocks cannot hold it, whatever the policy. With an admission policy
//! (prefix-tinylfu) a prefix save may stop early; the model checks it saved a prefix. After every step
//! [`Machine::check`] verifies: no slot owned twice, every indexed block in the state the model says
//! (ready with exactly the modelled pins, or writing), free slots = free list = capacity - owned,
//! every ready slot's bytes are its key's pattern, leases settled as modelled, stats equal.
//!
//! Pool "resize": the tier has no resize (an engine sizes the host pool at start-up). `Resize` drains
//! (completes every copy, drops every lease), builds a new tier of the new capacity and re-saves the
//! resident blocks oldest first, as an engine migrating to a differently sized pool would; the model
//! predicts which blocks survive (the newest that fit).
#![allow(dead_code)]

use kvtier::internals::SlotState;
use kvtier::SlotId;
use kvtier::{
    ArenaSpec, BackingChoice, Completion, ContentKey, CopyBackend, CopyError, CopyHandle, CopyPair, EngineArenas, Fit,
    Geometry, HintId, HostPool, HostTier, Lease, PolicyKind, Rank, SaveOptions, TierConfig, TierError, TierStats,
    WaitFor,
};
use kvtier::{MemcpyArenas, MemcpyBackend};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Keys `0..KEYS` exist.
pub const KEYS: u8 = 10;
/// Longest key range of one save or query, and most blocks one restore copies.
pub const MAX_SPAN: u8 = 4;
/// Largest pool, in slots.
pub const MAX_CAPACITY: u8 = 6;
/// GPU pages per arena: sources `0..KEYS`, restore destinations `KEYS..KEYS + MAX_SPAN`.
pub const PAGES: u64 = (KEYS + MAX_SPAN) as u64;

/// One step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Save keys `start..start + len` (clamped to `KEYS`), plus key `start` once more at the end
    /// if `dup`; on rank A (completes later) if `gated`, else on rank B (waited for). `prefix`
    /// selects [`Fit::Prefix`] instead of all-or-nothing.
    Save { gated: bool, start: u8, len: u8, prefix: bool, dup: bool },
    /// Completes rank A's oldest pending save (`save`) or restore, successfully or with an injected
    /// copy failure. No-op when none is pending.
    Complete { save: bool, ok: bool },
    /// Queries keys `start..start + len` with `uses` uses; the lease is kept.
    Query { start: u8, len: u8, uses: u8 },
    /// Restores the first `n` blocks of kept lease number `lease` (modulo the count) into pages
    /// `KEYS..KEYS + n`, on rank A (pending) if `gated`, else rank B (waited for and verified).
    Restore { lease: u8, n: u8, gated: bool },
    /// Releases a kept lease (it stays kept, settled).
    Release { lease: u8 },
    /// Drops a kept lease.
    Drop { lease: u8 },
    /// Evicts up to `n` blocks (`HostTier::evict`).
    Evict { n: u8 },
    /// Rebuilds the tier with `capacity` slots (see the module docs).
    Resize { capacity: u8 },
    /// Saves keys `start..start + len` on rank B (waited for) as a chain: `prefix_depth(start)`,
    /// with key `start - 1` as the parent, so the tier links them (chain-aware eviction).
    ChainSave { start: u8, len: u8 },
    /// Hints keys `start..start + len` ([`HostTier::hint`], a long time-to-live); the hint is kept.
    Hint { start: u8, len: u8 },
    /// Withdraws kept hint number `hint` (modulo the count).
    Withdraw { hint: u8 },
}

impl Op {
    /// Decodes one op from raw bytes (for the fuzz target); `None` when the input is exhausted.
    pub fn decode(data: &mut &[u8]) -> Option<Op> {
        let (&tag, rest) = data.split_first()?;
        let (&arg, rest) = rest.split_first().unwrap_or((&0, rest));
        *data = rest;
        let bit = |i: u8| arg >> i & 1 == 1;
        Some(match tag % 11 {
            0 => Op::Save {
                gated: bit(0),
                start: (arg >> 2) % KEYS,
                len: 1 + (arg >> 6) % MAX_SPAN,
                prefix: bit(1),
                dup: tag & 0x80 != 0,
            },
            1 => Op::Complete { save: bit(0), ok: arg & 0b110 != 0 },
            2 => Op::Query { start: (arg >> 2) % KEYS, len: 1 + (arg >> 6) % MAX_SPAN, uses: arg % 3 },
            3 => Op::Restore { lease: arg >> 4, n: (arg >> 1) % (MAX_SPAN + 1), gated: bit(0) },
            4 => Op::Release { lease: arg },
            5 => Op::Drop { lease: arg },
            6 => Op::Evict { n: arg % 4 },
            7 => Op::Resize { capacity: 1 + arg % MAX_CAPACITY },
            8 => Op::ChainSave { start: (arg >> 2) % KEYS, len: 1 + (arg >> 6) % MAX_SPAN },
            9 => Op::Hint { start: (arg >> 2) % KEYS, len: 1 + (arg >> 6) % MAX_SPAN },
            _ => Op::Withdraw { hint: arg },
        })
    }
}

/// Two arenas (64 B and 32 B per page), `PAGES` pages: 512 B slots.
pub fn geometry() -> Geometry {
    Geometry::new("machine", 16, vec![ArenaSpec::packed("k", 64, PAGES), ArenaSpec::packed("v", 32, PAGES)])
        .expect("valid geometry")
}

// ---------------------------------------------------------------------------------------------
// The controlled backend.

/// A completion signal: `None` until the machine decides, then `Some(ok)`.
#[derive(Clone, Default)]
struct Signal(Arc<(Mutex<Option<bool>>, Condvar)>);

impl Signal {
    fn set(&self, ok: bool) {
        let mut g = self.0 .0.lock().unwrap();
        if g.is_none() {
            *g = Some(ok);
        }
        self.0 .1.notify_all();
    }
    fn wait(&self) -> bool {
        let mut g = self.0 .0.lock().unwrap();
        loop {
            if let Some(ok) = *g {
                return ok;
            }
            g = self.0 .1.wait(g).unwrap();
        }
    }
}

/// The signals of rank A's submitted copies, per direction, in submission order.
#[derive(Default)]
struct Control {
    saves: Mutex<VecDeque<Signal>>,
    restores: Mutex<VecDeque<Signal>>,
}

impl Control {
    fn next(&self, save: bool) -> Signal {
        let q = if save { &self.saves } else { &self.restores };
        q.lock().unwrap().pop_front().expect("a submitted copy is pending")
    }
    /// Lets every pending copy complete (successfully); used before tearing a tier down.
    fn open_all(&self) {
        for q in [&self.saves, &self.restores] {
            for s in q.lock().unwrap().drain(..) {
                s.set(true);
            }
        }
    }
}

struct ControlledBackend {
    inner: MemcpyBackend,
    control: Arc<Control>,
}

struct ControlledCompletion {
    inner: Box<dyn Completion>,
    signal: Signal,
}

impl Completion for ControlledCompletion {
    fn poll(&mut self) -> Result<bool, CopyError> {
        unimplemented!("the tier's completion threads wait")
    }
    fn wait(&mut self) -> Result<(), CopyError> {
        if !self.signal.wait() {
            // The copy "failed on the device": nothing was copied.
            return Err(CopyError::Injected { call: "machine" });
        }
        self.inner.wait()
    }
}

impl CopyBackend for ControlledBackend {
    fn name(&self) -> &'static str {
        "controlled"
    }
    fn geometry(&self) -> &Geometry {
        self.inner.geometry()
    }
    fn bind_pool(&mut self, pool: &HostPool) -> Result<(), CopyError> {
        self.inner.bind_pool(pool)
    }
    unsafe fn save(&self, b: &[CopyPair], w: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        // SAFETY: forwarded under the caller's contract (the copy runs in `wait`, after the signal).
        let inner = unsafe { self.inner.save(b, w) }?;
        let signal = Signal::default();
        self.control.saves.lock().unwrap().push_back(signal.clone());
        Ok(Box::new(ControlledCompletion { inner, signal }))
    }
    unsafe fn restore(&self, b: &[CopyPair], w: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        // SAFETY: forwarded under the caller's contract.
        let inner = unsafe { self.inner.restore(b, w) }?;
        let signal = Signal::default();
        self.control.restores.lock().unwrap().push_back(signal.clone());
        Ok(Box::new(ControlledCompletion { inner, signal }))
    }
}

// ---------------------------------------------------------------------------------------------
// The reference model.

#[derive(Clone, Debug)]
struct ModelBlock {
    /// LRU recency: larger is more recent.
    tick: u64,
    /// Lease pins plus restore-guard pins.
    pins: u32,
}

#[derive(Clone, Debug)]
struct ModelLease {
    keys: Vec<u8>,
    uses: u32,
    settled: bool,
}

#[derive(Clone, Debug, Default)]
struct Model {
    capacity: usize,
    /// Live hints per key (a key is hinted while any hint names it).
    hinted: BTreeMap<u8, u32>,
    clock: u64,
    ready: BTreeMap<u8, ModelBlock>,
    writing: BTreeSet<u8>,
    /// Rank A's saves in flight (keys in reservation order).
    pending_saves: VecDeque<Vec<u8>>,
    /// Rank A's restores in flight (keys they pin, in order).
    pending_restores: VecDeque<Vec<u8>>,
    stats: TierStats,
}

impl Model {
    fn new(capacity: usize) -> Self {
        Model { capacity, ..Default::default() }
    }
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }
    fn free(&self) -> usize {
        self.capacity - self.ready.len() - self.writing.len()
    }
    fn pinned(&self) -> usize {
        self.ready.values().filter(|b| b.pins > 0).count()
    }
    fn pin(&mut self, k: u8) {
        self.ready.get_mut(&k).expect("pinned block is ready").pins += 1;
    }
    fn unpin(&mut self, k: u8) {
        let b = self.ready.get_mut(&k).expect("pinned block is ready");
        assert!(b.pins > 0);
        b.pins -= 1;
    }
    fn settle(&mut self, l: &mut ModelLease) {
        if !l.settled {
            l.settled = true;
            for &k in &l.keys {
                self.unpin(k);
            }
        }
    }
    /// The unpinned ready blocks (what eviction may take), unhinted before hinted, least recently
    /// used first within each.
    fn evictable(&self) -> Vec<u8> {
        let mut cands: Vec<(bool, u64, u8)> =
            self.ready.iter().filter(|(_, b)| b.pins == 0).map(|(&k, b)| (self.is_hinted(k), b.tick, k)).collect();
        cands.sort_unstable();
        cands.into_iter().map(|(_, _, k)| k).collect()
    }
    fn is_hinted(&self, k: u8) -> bool {
        self.hinted.get(&k).is_some_and(|&n| n > 0)
    }
    fn commit(&mut self, keys: &[u8], block_bytes: u64) {
        for &k in keys {
            assert!(self.writing.remove(&k));
            let t = self.tick();
            self.ready.insert(k, ModelBlock { tick: t, pins: 0 });
        }
        self.stats.saved_blocks += keys.len() as u64;
        self.stats.bytes_saved += keys.len() as u64 * block_bytes;
    }
    fn abort(&mut self, keys: &[u8]) {
        for &k in keys {
            assert!(self.writing.remove(&k));
        }
        self.stats.save_failed_blocks += keys.len() as u64;
    }
    /// The stats the tier must report now (`live_leases`: the unsettled leases the machine holds).
    fn expected_stats(&self, live_leases: u64) -> TierStats {
        let mut s = self.stats.clone();
        s.pinned_slots = self.pinned() as u64;
        s.ready_slots = self.ready.len() as u64;
        s.writing_slots = self.writing.len() as u64;
        s.free_slots = self.free() as u64;
        s.capacity = self.capacity as u64;
        s.index_entries = (self.ready.len() + self.writing.len()) as u64;
        s.live_leases = live_leases;
        s
    }
}

/// What the model says of a save before the tier's answer is known.
#[derive(Debug)]
struct SavePlan {
    /// Indices of the keys to save, in order.
    missing: Vec<usize>,
    resident: usize,
    in_flight: usize,
    duplicates: usize,
    /// Free plus unpinned ready slots, less this save's resident blocks (the save pins them).
    available: usize,
    /// `available` less the unpinned ready blocks of hinted keys (what a protecting prefix save
    /// may take).
    unhinted: usize,
    /// This save's resident keys: never evicted by it.
    resident_keys: Vec<u8>,
}

// ---------------------------------------------------------------------------------------------
// The machine.

/// The tier, its two ranks and the model, advanced together (see the module docs).
pub struct Machine {
    geometry: Geometry,
    keys: Vec<ContentKey>,
    policy: PolicyKind,
    /// The tier's queue-protecting admission ([`TierConfig::protect_hinted`]).
    protect_hinted: bool,
    /// Chain-aware victims ([`TierConfig::chain_aware`]).
    chain_aware: bool,
    model: Model,
    leases: Vec<(Lease, ModelLease)>,
    /// Kept hints and their keys.
    hints: Vec<(HintId, Vec<u8>)>,
    /// Handles of rank A's pending saves / restores, oldest first.
    save_handles: VecDeque<CopyHandle>,
    restore_handles: VecDeque<(CopyHandle, Vec<u8>)>,
    arenas_a: Arc<MemcpyArenas>,
    arenas_b: Arc<MemcpyArenas>,
    control: Arc<Control>,
    // Declared before `tier`: ranks drop (draining) first. Dropping opens every pending signal.
    rank_a: Option<Rank>,
    rank_b: Option<Rank>,
    tier: HostTier,
    /// Steps taken (for failure messages).
    pub steps: usize,
}

const WAIT: Duration = Duration::from_secs(20);

fn wait(h: &CopyHandle, what: &str) -> Result<(), TierError> {
    h.wait_timeout(WAIT).unwrap_or_else(|| panic!("{what}: copy handle not complete after {WAIT:?}"))
}

impl Machine {
    /// A machine with a `capacity`-slot tier evicting with `policy`.
    pub fn new(policy: PolicyKind, capacity: u8) -> Self {
        Self::with_protect(policy, capacity, false)
    }

    /// [`Machine::new`] whose tier has queue-protecting admission
    /// ([`TierConfig::protect_hinted`]) on or off.
    pub fn with_protect(policy: PolicyKind, capacity: u8, protect_hinted: bool) -> Self {
        Self::with_options(policy, capacity, protect_hinted, policy != PolicyKind::Lru)
    }

    /// [`Machine::with_protect`] with chain-aware victims on or off (by default on for every
    /// policy but LRU, whose victims the model predicts exactly only without chains).
    pub fn with_options(policy: PolicyKind, capacity: u8, protect_hinted: bool, chain_aware: bool) -> Self {
        let geometry = geometry();
        let arenas_a = Arc::new(MemcpyArenas::new(&geometry).expect("arenas"));
        let arenas_b = Arc::new(MemcpyArenas::new(&geometry).expect("arenas"));
        let tier = Self::build_tier(&geometry, policy, capacity, protect_hinted, chain_aware);
        let keys: Vec<ContentKey> = (0..KEYS as u64).map(|i| tier.namespace().trace_page_key(i, 0)).collect();
        let pages: Vec<u64> = (0..KEYS as u64).collect();
        arenas_a.fill(&pages, &keys).expect("fill");
        arenas_b.fill(&pages, &keys).expect("fill");
        let control = Arc::new(Control::default());
        let mut m = Machine {
            geometry,
            keys,
            policy,
            protect_hinted,
            chain_aware,
            model: Model::new(capacity as usize),
            leases: Vec::new(),
            hints: Vec::new(),
            save_handles: VecDeque::new(),
            restore_handles: VecDeque::new(),
            arenas_a,
            arenas_b,
            control,
            rank_a: None,
            rank_b: None,
            tier,
            steps: 0,
        };
        m.attach();
        m.check();
        m
    }

    /// The model predicts LRU's victims exactly without chain-aware ranking (with it, chain
    /// saves reorder victims by their chains, and only the other invariants are checked).
    fn build_tier(g: &Geometry, policy: PolicyKind, capacity: u8, protect_hinted: bool, chain_aware: bool) -> HostTier {
        let cfg = TierConfig::new(g.clone(), capacity as u64 * g.slot_bytes())
            .with_policy(policy)
            .with_protect_hinted(protect_hinted)
            .with_chain_aware(chain_aware)
            .with_backing(BackingChoice::Plain);
        HostTier::new(cfg).expect("tier")
    }

    fn attach(&mut self) {
        let a = ControlledBackend { inner: MemcpyBackend::new(self.arenas_a.clone()), control: self.control.clone() };
        self.rank_a = Some(self.tier.attach(Box::new(a)).expect("attach A"));
        self.rank_b = Some(self.tier.attach(self.arenas_b.backend().expect("backend")).expect("attach B"));
    }

    /// The tier under test.
    pub fn tier(&self) -> &HostTier {
        &self.tier
    }

    /// Applies `op` to the tier and the model, then checks every invariant (panics on a violation).
    pub fn step(&mut self, op: Op) {
        self.steps += 1;
        match op {
            Op::Save { gated, start, len, prefix, dup } => self.save(gated, start, len, prefix, dup),
            Op::Complete { save: true, ok } => self.complete_save(ok),
            Op::Complete { save: false, ok } => self.complete_restore(ok),
            Op::Query { start, len, uses } => self.query(start, len, uses),
            Op::Restore { lease, n, gated } => self.restore(lease, n, gated),
            Op::Release { lease } => self.release(lease),
            Op::Drop { lease } => self.drop_lease(lease),
            Op::Evict { n } => {
                let want = (n as usize).min(self.model.evictable().len());
                let got = self.tier.evict(n as usize);
                assert_eq!(got, want, "evict({n}) with {} evictable ({})", self.model.evictable().len(), self.policy);
                self.observe_evictions(want, "evict", &[]);
            }
            Op::Resize { capacity } => self.resize(capacity.clamp(1, MAX_CAPACITY)),
            Op::ChainSave { start, len } => self.save_with(false, start, len, false, false, true),
            Op::Hint { start, len } => {
                let ks: Vec<u8> = Self::span(start, len).collect();
                let keys: Vec<ContentKey> = ks.iter().map(|&k| self.keys[k as usize]).collect();
                let id = self.tier.hint(&keys, Duration::from_secs(3600));
                let mut named = ks.clone();
                named.dedup();
                for &k in &named {
                    *self.model.hinted.entry(k).or_insert(0) += 1;
                }
                self.hints.push((id, named));
            }
            Op::Withdraw { hint } => {
                if !self.hints.is_empty() {
                    let (id, ks) = self.hints.remove(hint as usize % self.hints.len());
                    assert!(self.tier.withdraw_hint(id), "withdrawing live hint {id:?}");
                    for k in ks {
                        *self.model.hinted.get_mut(&k).expect("hinted key") -= 1;
                    }
                }
            }
        }
        self.check();
    }

    /// Runs every op with `policy`, checking after each.
    pub fn run(policy: PolicyKind, capacity: u8, ops: &[Op]) {
        Self::run_with(policy, capacity, false, ops)
    }

    /// [`Machine::run`] with queue-protecting admission on or off ([`Machine::with_protect`]).
    pub fn run_with(policy: PolicyKind, capacity: u8, protect_hinted: bool, ops: &[Op]) {
        Self::run_machine(Machine::with_protect(policy, capacity, protect_hinted), ops)
    }

    /// [`Machine::run`] with chain-aware victims on or off ([`Machine::with_options`]).
    pub fn run_chain_aware(policy: PolicyKind, capacity: u8, chain_aware: bool, ops: &[Op]) {
        Self::run_machine(Machine::with_options(policy, capacity, false, chain_aware), ops)
    }

    fn run_machine(mut m: Machine, ops: &[Op]) {
        for &op in ops {
            m.step(op);
        }
        m.finish();
    }

    fn span(start: u8, len: u8) -> std::ops::Range<u8> {
        let s = start.min(KEYS);
        s..(s + len).min(KEYS)
    }

    /// Classifies a save's keys as the tier's plan must (refreshing resident blocks' recency).
    fn plan_save(&mut self, keys: &[u8]) -> SavePlan {
        let m = &mut self.model;
        let mut plan = SavePlan {
            missing: Vec::new(),
            resident: 0,
            in_flight: 0,
            duplicates: 0,
            available: 0,
            unhinted: 0,
            resident_keys: vec![],
        };
        let mut seen = BTreeSet::new();
        for (i, &k) in keys.iter().enumerate() {
            if !seen.insert(k) {
                plan.duplicates += 1;
            } else if m.ready.contains_key(&k) {
                let t = m.tick();
                m.ready.get_mut(&k).unwrap().tick = t;
                plan.resident += 1;
                plan.resident_keys.push(k);
            } else if m.writing.contains(&k) {
                plan.in_flight += 1;
            } else {
                plan.missing.push(i);
            }
        }
        m.stats.save_skipped_resident += plan.resident as u64;
        m.stats.save_skipped_in_flight += plan.in_flight as u64;
        m.stats.save_skipped_duplicate += plan.duplicates as u64;
        let protected = plan.resident_keys.iter().filter(|k| m.ready[k].pins == 0).count();
        plan.available = m.free() + m.ready.len() - m.pinned() - protected;
        let hinted = m.ready.iter().filter(|(k, b)| b.pins == 0 && !plan.resident_keys.contains(k) && m.is_hinted(**k));
        plan.unhinted = plan.available - hinted.count();
        plan
    }

    /// The tier evicted `n` blocks just now: checks that they were unpinned ready blocks, that a
    /// hinted block went only if every unhinted candidate went too (for LRU: exactly the `n` least
    /// recently used, unhinted first) and removes them from the model.
    fn observe_evictions(&mut self, n: usize, what: &str, protect: &[u8]) {
        let cands: Vec<u8> = self.model.evictable().into_iter().filter(|k| !protect.contains(k)).collect();
        let gone: Vec<u8> =
            self.model.ready.keys().copied().filter(|&k| !self.tier.contains(&self.keys[k as usize])).collect();
        assert_eq!(gone.len(), n, "{what} ({}): evicted {gone:?}, expected {n} blocks", self.policy);
        for k in &gone {
            assert!(cands.contains(k), "{what} ({}): evicted key {k}, which was pinned", self.policy);
        }
        if gone.iter().any(|&k| self.model.is_hinted(k)) {
            for k in cands.iter().filter(|&&k| !self.model.is_hinted(k)) {
                assert!(
                    gone.contains(k),
                    "{what} ({}): evicted hinted blocks ({gone:?}) while unhinted key {k} stayed evictable",
                    self.policy
                );
            }
        }
        if self.policy == PolicyKind::Lru && !self.chain_aware {
            let want: BTreeSet<u8> = cands[..n].iter().copied().collect();
            assert_eq!(gone.iter().copied().collect::<BTreeSet<u8>>(), want, "{what}: LRU victims");
        }
        for k in gone {
            self.model.ready.remove(&k);
        }
        self.model.stats.evictions += n as u64;
        if what == "evict" {
            // Asked for (`HostTier::evict`); a save's evictions are for capacity.
            self.model.stats.explicit_evictions += n as u64;
        }
    }

    fn save(&mut self, gated: bool, start: u8, len: u8, prefix: bool, dup: bool) {
        self.save_with(gated, start, len, prefix, dup, false)
    }

    fn save_with(&mut self, gated: bool, start: u8, len: u8, prefix: bool, dup: bool, chain: bool) {
        let mut ks: Vec<u8> = Self::span(start, len).collect();
        if ks.is_empty() {
            return;
        }
        if dup {
            ks.push(ks[0]);
        }
        let keys: Vec<ContentKey> = ks.iter().map(|&k| self.keys[k as usize]).collect();
        let pages: Vec<u64> = ks.iter().map(|&k| k as u64).collect();
        let fit = if prefix { Fit::Prefix } else { Fit::AllOrNothing };
        let rank = if gated { self.rank_a.as_ref() } else { self.rank_b.as_ref() }.expect("attached");
        let mut opts = SaveOptions::new().fit(fit);
        // A prefix save carries its depths, as an engine's does (probationary admission counts
        // its pages from there).
        if chain || prefix {
            opts = opts.prefix_depth(ks[0] as u32);
        }
        if chain && ks[0] > 0 {
            opts = opts.parent(self.keys[ks[0] as usize - 1]);
        }
        let got = rank.save_with(&keys, &pages, WaitFor::Nothing, opts);
        let plan = self.plan_save(&ks);
        let need = plan.missing.len();
        let t = match got {
            Err(TierError::CannotFit { needed, available, capacity }) => {
                assert_eq!(fit, Fit::AllOrNothing, "only all-or-nothing saves are refused for lack of room");
                assert!(
                    need > plan.available,
                    "save of keys {ks:?} refused, yet {} slots were available",
                    plan.available
                );
                assert_eq!(
                    (needed, available, capacity),
                    (need, plan.available, self.model.capacity),
                    "CannotFit fields"
                );
                self.model.stats.saves_refused += 1;
                return;
            }
            Ok(t) => t,
            Err(e) => panic!("save of keys {ks:?} ({fit:?}, {}): unexpected {e:?}; model: {plan:?}", self.policy),
        };
        assert_eq!(
            (t.resident, t.in_flight, t.duplicates),
            (plan.resident, plan.in_flight, plan.duplicates),
            "save ticket for keys {ks:?}"
        );
        // With queue-protecting admission a prefix save takes no hinted block.
        let protecting = fit == Fit::Prefix && self.protect_hinted;
        let take = need.min(if protecting { plan.unhinted } else { plan.available });
        match fit {
            Fit::AllOrNothing => assert_eq!(t.saving, plan.missing, "save of keys {ks:?}: saved keys"),
            _ => {
                assert!(
                    t.saving.len() <= take && t.saving[..] == plan.missing[..t.saving.len()],
                    "prefix save of keys {ks:?}: saved {:?}, model {plan:?}",
                    t.saving
                );
                // Only an admission policy may save less than fits. Probationary admission (2Q, and
                // the default for a save of more than 3/4 of the pool) places at least every
                // missing key at a position below the free slots plus the probation target (10%
                // of the pool, at least 1); a key at position `i` of the save has depth
                // `ks[0] + i`.
                let cap = self.model.capacity;
                let floods = match self.policy {
                    PolicyKind::PrefixTinyLfu => None,
                    PolicyKind::TwoQ => Some(true),
                    PolicyKind::AdaptiveLfu => Some(need > cap - cap / 4),
                    _ => Some(false),
                };
                if let Some(floods) = floods {
                    let room = self.model.free() + (cap / 10).max(1);
                    let must =
                        if floods { plan.missing.iter().take_while(|&&i| i < room).count().min(take) } else { take };
                    assert!(
                        t.saving.len() >= must,
                        "prefix save of keys {ks:?}: liveness ({}): saved {} keys, at least {must} of {take} must be \
                         (room {room})",
                        self.policy,
                        t.saving.len()
                    );
                }
            }
        }
        assert_eq!(t.dropped, need - t.saving.len(), "dropped");
        self.model.stats.save_dropped += t.dropped as u64;
        let saved: Vec<u8> = t.saving.iter().map(|&i| ks[i]).collect();
        let evicted = saved.len().saturating_sub(self.model.free());
        let hinted_before: Vec<u8> = self.model.ready.keys().copied().filter(|&k| self.model.is_hinted(k)).collect();
        self.observe_evictions(evicted, "save", &plan.resident_keys);
        if protecting {
            for k in hinted_before {
                assert!(
                    self.model.ready.contains_key(&k),
                    "prefix save of keys {ks:?} ({}): evicted hinted key {k} although the tier protects hinted blocks",
                    self.policy
                );
            }
        }
        for &k in &saved {
            assert!(self.model.writing.insert(k));
        }
        if saved.is_empty() {
            assert!(t.handle.is_done(), "a save that copies nothing is complete at once");
        } else if gated {
            self.save_handles.push_back(t.handle);
            self.model.pending_saves.push_back(saved);
        } else {
            wait(&t.handle, "save on rank B").expect("host save succeeds");
            self.model.commit(&saved, self.geometry.block_bytes());
        }
    }

    fn complete_save(&mut self, ok: bool) {
        let Some(keys) = self.model.pending_saves.pop_front() else { return };
        let h = self.save_handles.pop_front().expect("handle of a pending save");
        self.control.next(true).set(ok);
        let r = wait(&h, "save on rank A");
        if ok {
            r.expect("a save whose copy succeeded");
            self.model.commit(&keys, self.geometry.block_bytes());
        } else {
            assert!(r.is_err(), "a failed copy fails the save's handle");
            self.model.abort(&keys);
        }
    }

    fn complete_restore(&mut self, ok: bool) {
        let Some(keys) = self.model.pending_restores.pop_front() else { return };
        let (h, hk) = self.restore_handles.pop_front().expect("handle of a pending restore");
        assert_eq!(hk, keys);
        self.control.next(false).set(ok);
        let r = wait(&h, "restore on rank A");
        self.finish_restore(&keys, ok, r, true);
    }

    fn finish_restore(&mut self, keys: &[u8], ok: bool, r: Result<(), TierError>, on_a: bool) {
        let n = keys.len() as u64;
        if ok {
            r.expect("a restore whose copy succeeded");
            let pages: Vec<u64> = (0..n).map(|i| KEYS as u64 + i).collect();
            let want: Vec<ContentKey> = keys.iter().map(|&k| self.keys[k as usize]).collect();
            let arenas = if on_a { &self.arenas_a } else { &self.arenas_b };
            if let Err(e) = arenas.verify(&pages, &want) {
                panic!("restored bytes of keys {keys:?} differ: {e}");
            }
            self.model.stats.restored_blocks += n;
            self.model.stats.bytes_restored += n * self.geometry.block_bytes();
        } else {
            assert!(r.is_err(), "a failed copy fails the restore's handle");
            self.model.stats.restore_failed_blocks += n;
        }
        for &k in keys {
            self.model.unpin(k);
        }
    }

    fn query(&mut self, start: u8, len: u8, uses: u8) {
        let ks: Vec<u8> = Self::span(start, len).collect();
        let keys: Vec<ContentKey> = ks.iter().map(|&k| self.keys[k as usize]).collect();
        let lease = self.tier.query_shared(&keys, uses as u32);
        let m = &mut self.model;
        let mut found = Vec::new();
        for &k in &ks {
            if !m.ready.contains_key(&k) {
                break;
            }
            let t = m.tick();
            let b = m.ready.get_mut(&k).unwrap();
            b.tick = t;
            b.pins += 1;
            found.push(k);
        }
        m.stats.queries += 1;
        m.stats.hit_blocks += found.len() as u64;
        m.stats.miss_blocks += (ks.len() - found.len()) as u64;
        let mut ml = ModelLease { keys: found.clone(), uses: uses as u32, settled: false };
        if found.is_empty() || uses == 0 {
            m.settle(&mut ml);
        }
        let got: Vec<ContentKey> = lease.blocks().iter().map(|b| b.key).collect();
        let want: Vec<ContentKey> = found.iter().map(|&k| self.keys[k as usize]).collect();
        assert_eq!(got, want, "query of keys {ks:?} leased the wrong prefix");
        self.leases.push((lease, ml));
    }

    fn restore(&mut self, lease: u8, n: u8, gated: bool) {
        if self.leases.is_empty() {
            return;
        }
        let i = lease as usize % self.leases.len();
        let n = n.min(MAX_SPAN) as usize;
        let pages: Vec<u64> = (0..n as u64).map(|p| KEYS as u64 + p).collect();
        let rank = if gated { self.rank_a.as_ref() } else { self.rank_b.as_ref() }.expect("attached");
        let got = rank.restore(&self.leases[i].0, &pages, WaitFor::Nothing);
        let mut ml = self.leases[i].1.clone();
        let held = ml.keys.len();
        if n > held {
            assert!(
                matches!(got, Err(TierError::LeaseTooShort { asked, held: h }) if asked == n && h == held),
                "restore of {n} from a {held}-block lease: {got:?}"
            );
        } else if n == 0 {
            // Nothing to copy: a no-op that uses up one restore of an unsettled lease.
            let h = got.unwrap_or_else(|e| panic!("restore of 0 blocks: {e}"));
            assert!(h.is_done());
            if !ml.settled {
                ml.uses -= 1;
                if ml.uses == 0 {
                    self.model.settle(&mut ml);
                }
            }
        } else if ml.settled {
            assert!(matches!(got, Err(TierError::LeaseSettled)), "restore from a settled lease: {got:?}");
        } else {
            let h = got.unwrap_or_else(|e| panic!("restore of {n} blocks from a live lease: {e}"));
            let keys = ml.keys[..n].to_vec();
            for &k in &keys {
                self.model.pin(k); // the restore's guard
            }
            ml.uses -= 1;
            if ml.uses == 0 {
                self.model.settle(&mut ml);
            }
            if gated {
                self.restore_handles.push_back((h, keys.clone()));
                self.model.pending_restores.push_back(keys);
            } else {
                let r = wait(&h, "restore on rank B");
                self.finish_restore(&keys, true, r, false);
            }
        }
        self.leases[i].1 = ml;
    }

    fn release(&mut self, lease: u8) {
        if self.leases.is_empty() {
            return;
        }
        let i = lease as usize % self.leases.len();
        let settled_now = self.leases[i].0.clone().release();
        let mut ml = self.leases[i].1.clone();
        assert_eq!(settled_now, !ml.settled, "release settles iff the lease was unsettled");
        self.model.settle(&mut ml);
        self.leases[i].1 = ml;
    }

    fn drop_lease(&mut self, lease: u8) {
        if self.leases.is_empty() {
            return;
        }
        let i = lease as usize % self.leases.len();
        let (l, mut ml) = self.leases.remove(i);
        drop(l);
        self.model.settle(&mut ml);
    }

    /// Completes every pending copy successfully and drops every lease.
    fn drain(&mut self) {
        while !self.model.pending_saves.is_empty() {
            self.complete_save(true);
        }
        while !self.model.pending_restores.is_empty() {
            self.complete_restore(true);
        }
        while !self.leases.is_empty() {
            self.drop_lease(0);
        }
    }

    fn resize(&mut self, capacity: u8) {
        self.drain();
        let mut resident: Vec<(u64, u8)> = self.model.ready.iter().map(|(&k, b)| (b.tick, k)).collect();
        resident.sort_unstable();
        self.rank_a = None;
        self.rank_b = None;
        // Hints belong to the old tier.
        self.hints.clear();
        self.tier = Self::build_tier(&self.geometry, self.policy, capacity, self.protect_hinted, self.chain_aware);
        self.model = Model::new(capacity as usize);
        self.attach();
        for (_, k) in resident {
            // One block per save, oldest first: when the new pool is smaller, LRU drops the oldest.
            self.save(false, k, 1, false, false);
        }
    }

    /// Checks every invariant of the tier against the model (see the module docs).
    pub fn check(&self) {
        let m = &self.model;
        let core = kvtier::internals::core(&self.tier);
        let control = core.control();
        let cap = self.tier.capacity();
        assert_eq!(cap as usize, m.capacity, "capacity");
        // Every key: indexed iff ready or writing, in the modelled state; no slot owned twice.
        let mut owner: Vec<Option<u8>> = vec![None; cap as usize];
        for k in 0..KEYS {
            let key = &self.keys[k as usize];
            let entry = core.index().get(key);
            let want = if let Some(b) = m.ready.get(&k) {
                Some((SlotState::Ready, b.pins))
            } else if m.writing.contains(&k) {
                Some((SlotState::Writing, 0))
            } else {
                None
            };
            match (entry, want) {
                (None, None) => {}
                (Some(r), Some((state, pins))) => {
                    assert!(r.slot.get() < cap, "key {k}: slot {} out of range", r.slot.get());
                    let w = control.load(r.slot);
                    assert_eq!(
                        (w.state(), w.pins(), w.generation()),
                        (state, pins, r.generation),
                        "key {k} in slot {}: word {w:?}",
                        r.slot.get()
                    );
                    if let Some(other) = owner[r.slot.index()].replace(k) {
                        panic!("slot {} owned by keys {other} and {k}", r.slot.get());
                    }
                    if state == SlotState::Ready {
                        self.check_bytes(k, r.slot);
                    }
                    assert_eq!(self.tier.contains(key), state == SlotState::Ready, "contains(key {k})");
                }
                (entry, want) => panic!("key {k}: index has {entry:?}, model expects {want:?}"),
            }
        }
        // Unowned slots are free, and exactly those are on the free list.
        let mut free = 0;
        for s in 0..cap {
            let w = control.load(SlotId::new(s));
            if owner[s as usize].is_none() {
                assert_eq!((w.state(), w.pins()), (SlotState::Free, 0), "unowned slot {s}: {w:?}");
                free += 1;
            }
        }
        assert_eq!(free, m.free(), "free slots");
        assert_eq!(core.pool().free_count(), free, "free list length");
        // Leases as modelled.
        for (l, ml) in &self.leases {
            assert_eq!(l.is_settled(), ml.settled, "lease on keys {:?}: settled", ml.keys);
            assert_eq!(l.uses_left(), if ml.settled { 0 } else { ml.uses }, "lease on keys {:?}: uses", ml.keys);
        }
        let live = self.leases.iter().filter(|(_, ml)| !ml.settled).count() as u64;
        assert_eq!(self.tier.stats(), m.expected_stats(live), "stats after step {} ({})", self.steps, self.policy);
        // The tier's own audit agrees (it also checks each slot's recorded key).
        let audit = core.audit(&self.keys).unwrap_or_else(|e| panic!("audit after step {}: {e}", self.steps));
        assert_eq!(
            (audit.free, audit.writing, audit.ready, audit.evicting, audit.pinned),
            (m.free(), m.writing.len(), m.ready.len(), 0, m.pinned()),
            "audit"
        );
    }

    fn check_bytes(&self, k: u8, slot: SlotId) {
        let pool = self.tier.pool();
        let base = pool.slot_ptr(slot);
        let key = &self.keys[k as usize];
        for (a, (spec, &off)) in self.geometry.arenas().iter().zip(self.geometry.chunk_offsets()).enumerate() {
            // SAFETY: the slot is READY (checked by the caller): no copy writes it until it is evicted,
            // and eviction happens only inside this thread's tier calls. The chunk lies inside the
            // slot (offset + copy unit <= slot_bytes).
            let chunk = unsafe { std::slice::from_raw_parts(base.add(off as usize), spec.bytes_per_page as usize) };
            if let Some(b) = kvtier::pattern::first_mismatch(key, a, chunk) {
                panic!("ready slot {} of key {k}: arena {a} byte {b} is not the key's pattern", slot.get());
            }
        }
    }

    /// Completes everything, drops every lease and checks the tier is quiescent: no pins, nothing
    /// writing.
    pub fn finish(mut self) {
        self.drain();
        self.check();
        let s = self.tier.stats();
        assert_eq!((s.pinned_slots, s.writing_slots), (0, 0));
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        // Never leave a rank blocked on an unopened signal (a failed check unwinds through here).
        self.control.open_all();
    }
}

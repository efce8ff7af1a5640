//! Eviction across cache groups: each group's tier evicts by its own policy, and the hybrid tier
//! marks **cold** (first victims, ranked with chain-aware orphans: see the tier's cold marks) the
//! blocks of the other groups that no restore can use:
//!
//! - **Broken prefix.** When a full-attention group evicts the block at position `i` of a prompt,
//!   every sliding-window block and state checkpoint at position `i` or after, in every prompt
//!   continuing that block, needs it for any restore: they are marked cold. (The tier follows the
//!   full-attention groups' evictions through their eviction logs, read before each hybrid save
//!   of a group that is not full attention, so a save's own evictions count for its later groups.)
//! - **Behind every window.** A sliding-window block is worth keeping only while a restore at some
//!   live boundary reads it. A boundary is **live** from the save that ends there (or the query
//!   answered there) until a save continues the prompt from it; each window block counts the live
//!   boundaries whose window holds it, and a block whose count falls to 0 is marked cold (one still
//!   being written is marked once it is ready).
//!
//! A save clears the marks of the blocks it brings that its own end needs (a state checkpoint it
//! saves, the window blocks before its end), so a prefix saved again after a break is whole again.
//! Marks are preferences: a cold block that is pinned stays, every block remains evictable, and a
//! missed mark (a log that overflowed, a walk cut at [`WALK_LIMIT`] blocks, a full-attention block
//! evicted before the save that brought it returned) only leaves a block in its policy's order.
//!
//! What it keeps: the prompt tree (content key -> the content keys that continue it) of every
//! save through the tier, the live boundaries, the window counts and the owner of each
//! full-attention group key, each pruned to the keys still resident when it outgrows four times
//! its groups' capacity.

use super::layout::{GroupKind, HybridLayout};
use crate::key::ContentKey;
use crate::sync::{Arc, Mutex};
use crate::tier::cold::ColdOutcome;
use crate::tier::core::Core;
use std::collections::{HashMap, HashSet};
use std::ops::Range;

/// The most blocks one full-attention eviction's walk of the prompt tree visits (the rest keep
/// their policy order).
pub(crate) const WALK_LIMIT: usize = 1 << 16;

/// The hybrid tier's eviction state (see the module docs), shared by the tier and its ranks.
pub(crate) struct GroupEviction {
    layout: HybridLayout,
    cores: Vec<Arc<Core>>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Prompt tree: content key -> content keys of the blocks that continue it.
    children: HashMap<ContentKey, HashSet<ContentKey>>,
    /// Child links in `children` (for pruning).
    links: usize,
    /// Prompt tree upward: content key -> the content key before it.
    parent: HashMap<ContentKey, ContentKey>,
    /// Full-attention group key -> its content key (to read the eviction logs).
    owner: HashMap<ContentKey, ContentKey>,
    /// Live boundaries, named by the content key of the block before them, with the window
    /// blocks (group, group key) each covers.
    live: HashMap<ContentKey, Vec<(usize, ContentKey)>>,
    /// Per sliding-window group key, the live boundaries whose window holds it.
    covers: HashMap<ContentKey, u32>,
    /// Blocks to mark cold once their copy is done: (group, group key). A clear or a cover
    /// cancels the entry.
    pending: HashSet<(usize, ContentKey)>,
    /// Scratch for the eviction logs.
    evicted: Vec<ContentKey>,
}

impl std::fmt::Debug for GroupEviction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupEviction").field("groups", &self.cores.len()).finish_non_exhaustive()
    }
}

impl GroupEviction {
    pub(crate) fn new(layout: HybridLayout, cores: Vec<Arc<Core>>) -> Self {
        GroupEviction { layout, cores, state: Mutex::new(State::default()) }
    }

    fn kind(&self, g: usize) -> GroupKind {
        self.layout.groups()[g].kind
    }

    fn is_window(&self, g: usize) -> bool {
        matches!(self.kind(g), GroupKind::SlidingWindow { .. })
    }

    /// Marks group `g`'s block of group key `gk` cold, or remembers it for when its copy is done.
    fn mark(&self, st: &mut State, g: usize, gk: ContentKey) {
        if self.cores[g].mark_cold(&gk) == ColdOutcome::Writing {
            st.pending.insert((g, gk));
        }
    }

    /// Clears group `g`'s block of `gk` (its mark, and a mark waiting for its copy).
    fn unmark(&self, st: &mut State, g: usize, gk: ContentKey) {
        // Seeded bug (tests only): `pending-mark-kept` leaves a waiting mark in place.
        if !crate::seeded::seeded("pending-mark-kept") {
            st.pending.remove(&(g, gk));
        }
        self.cores[g].clear_cold(&gk);
    }

    /// Reads the full-attention groups' eviction logs and marks what each eviction broke; marks
    /// the pending blocks whose copies are done.
    pub(crate) fn settle(&self) {
        let mut st = crate::sync::lock(&self.state);
        self.settle_locked(&mut st);
    }

    fn settle_locked(&self, st: &mut State) {
        let pending: Vec<_> = st.pending.drain().collect();
        for (g, gk) in pending {
            self.mark(st, g, gk);
        }
        let mut evicted = std::mem::take(&mut st.evicted);
        for g in (0..self.cores.len()).filter(|&g| self.kind(g) == GroupKind::Full) {
            evicted.clear();
            self.cores[g].take_evicted(&mut evicted);
            for gk in &evicted {
                // Seeded bug (tests only): `hybrid-eviction-ungrouped` ignores the
                // full-attention evictions.
                if crate::seeded::seeded("hybrid-eviction-ungrouped") {
                    break;
                }
                // Saved again since (the log is read after the save that brought it back): the
                // prefix is whole, nothing to mark.
                if self.cores[g].find_block(gk).is_some() && !crate::seeded::seeded("stale-eviction-marks") {
                    continue;
                }
                if let Some(content) = st.owner.remove(gk) {
                    self.mark_subtree(st, content);
                    // The prompt's attention prefix now ends before this block: a restore there
                    // needs the window before it, so that boundary is live.
                    // (Seeded bug, tests only: `fallback-window-cold` leaves it dead.)
                    if let Some(&before) = st.parent.get(&content) {
                        if !crate::seeded::seeded("fallback-window-cold") {
                            self.add_live_at(st, before);
                        }
                    }
                }
            }
        }
        evicted.clear();
        st.evicted = evicted;
    }

    /// Marks cold every block of the groups that are not full attention at `root` and after it in
    /// the prompt tree (at most [`WALK_LIMIT`] tree nodes).
    fn mark_subtree(&self, st: &mut State, root: ContentKey) {
        let mut stack = vec![root];
        let mut seen = 0;
        while let Some(c) = stack.pop() {
            seen += 1;
            if seen > WALK_LIMIT {
                break;
            }
            for g in (0..self.cores.len()).filter(|&g| self.kind(g) != GroupKind::Full) {
                let gk = self.layout.group_key(g, &c);
                self.mark(st, g, gk);
            }
            if let Some(next) = st.children.get(&c) {
                stack.extend(next.iter().copied());
            }
        }
    }

    /// Boundary `b` (in blocks, of the prompt `keys`) becomes live: its window blocks gain a cover
    /// (a block covered for the first time loses its cold mark, or the mark waiting for it).
    fn add_live(&self, st: &mut State, keys: &[ContentKey], b: usize) {
        if b == 0 || st.live.contains_key(&keys[b - 1]) {
            return;
        }
        let mut covered = Vec::new();
        for g in (0..self.cores.len()).filter(|&g| self.is_window(g)) {
            for i in self.layout.needed(g, b) {
                covered.push((g, self.layout.group_key(g, &keys[i])));
            }
        }
        self.cover(st, keys[b - 1], covered);
    }

    /// The boundary after the block `at` becomes live, its window found through the prompt tree
    /// (the blocks before `at` as saves recorded them; a window cut short where the tree ends
    /// covers what it found).
    fn add_live_at(&self, st: &mut State, at: ContentKey) {
        if st.live.contains_key(&at) {
            return;
        }
        let longest = (0..self.cores.len())
            .filter(|&g| self.is_window(g))
            .map(|g| self.layout.needed(g, usize::MAX / 2).len())
            .max()
            .unwrap_or(0);
        let mut back = vec![at];
        while back.len() < longest {
            match st.parent.get(back.last().expect("not empty")) {
                Some(&p) => back.push(p),
                None => break,
            }
        }
        // `back[k]` is the block k before the boundary; a window of `w` blocks is `back[..w]`
        // (fewer near the prompt's start: the boundary is then `back.len()` blocks in).
        let reached_start = back.len() < longest;
        let mut covered = Vec::new();
        for g in (0..self.cores.len()).filter(|&g| self.is_window(g)) {
            let w = if reached_start {
                self.layout.needed(g, back.len()).len()
            } else {
                self.layout.needed(g, usize::MAX / 2).len()
            };
            for c in back.iter().take(w) {
                covered.push((g, self.layout.group_key(g, c)));
            }
        }
        self.cover(st, at, covered);
    }

    /// Records the live boundary named `at` covering `covered` (a block covered for the first
    /// time loses its cold mark, or the mark waiting for it).
    fn cover(&self, st: &mut State, at: ContentKey, covered: Vec<(usize, ContentKey)>) {
        for &(g, gk) in &covered {
            let n = st.covers.entry(gk).or_insert(0);
            *n += 1;
            if *n == 1 {
                self.unmark(st, g, gk);
            }
        }
        st.live.insert(at, covered);
    }

    /// The boundary named `at` is no longer live: a window block it alone covered is marked cold.
    fn drop_live(&self, st: &mut State, at: &ContentKey) {
        // Seeded bug (tests only): `window-cover-kept` never lets a boundary go.
        if crate::seeded::seeded("window-cover-kept") {
            return;
        }
        // A branch point (two or more prompts continue from it) stays live: the next prompt that
        // shares this prefix restores there.
        if st.children.get(at).is_some_and(|c| c.len() >= 2) {
            return;
        }
        let Some(covered) = st.live.remove(at) else { return };
        for (g, gk) in covered {
            let left = match st.covers.get_mut(&gk) {
                Some(n) => {
                    *n = n.saturating_sub(1);
                    *n
                }
                None => 0,
            };
            if left == 0 {
                st.covers.remove(&gk);
                self.mark(st, g, gk);
            }
        }
    }

    /// Before group `g`'s blocks of a hybrid save are submitted: the evictions so far are
    /// settled, so the save's own evictions in its earlier groups count.
    pub(crate) fn before_group_save(&self, g: usize) {
        if self.kind(g) != GroupKind::Full {
            self.settle();
        }
    }

    /// After a hybrid save of `keys` submitted blocks `ranges[g]` in group `g` (empty for a group
    /// given nothing or whose save failed): records the prompt tree and the full-attention
    /// owners, clears the marks of the blocks the save's end needs, makes its end a live boundary
    /// and lets go of the live boundaries it continued past (from where the full-attention
    /// groups' blocks began), then marks the window blocks no live boundary covers.
    pub(crate) fn after_save(&self, keys: &[ContentKey], ranges: &[Range<usize>]) {
        let brought = || ranges.iter().filter(|r| !r.is_empty());
        let Some(end) = brought().map(|r| r.end).max() else { return };
        let lo = brought().map(|r| r.start).min().unwrap_or(end);
        // Where the save continued the prompt from: the first block the full-attention groups
        // brought (the boundary the engine prefilled from), else the first block of any group.
        let from = ranges
            .iter()
            .enumerate()
            .filter(|(g, r)| self.kind(*g) == GroupKind::Full && !r.is_empty())
            .map(|(_, r)| r.start)
            .min()
            .unwrap_or(lo);
        let mut st = crate::sync::lock(&self.state);
        self.settle_locked(&mut st);
        for j in lo.max(1)..end {
            if st.children.entry(keys[j - 1]).or_default().insert(keys[j]) {
                st.links += 1;
            }
            st.parent.insert(keys[j], keys[j - 1]);
        }
        for (g, r) in ranges.iter().enumerate() {
            match self.kind(g) {
                GroupKind::Full => {
                    for j in r.clone() {
                        st.owner.insert(self.layout.group_key(g, &keys[j]), keys[j]);
                    }
                }
                GroupKind::State => {
                    for j in r.clone() {
                        self.unmark(&mut st, g, self.layout.group_key(g, &keys[j]));
                    }
                }
                GroupKind::SlidingWindow { .. } => {
                    let window = self.layout.needed(g, r.end);
                    for j in r.clone().filter(|j| window.contains(j)) {
                        self.unmark(&mut st, g, self.layout.group_key(g, &keys[j]));
                    }
                }
            }
        }
        // The new end first, so a window block both boundaries cover is never left uncovered.
        self.add_live(&mut st, keys, end);
        // Seeded bug (tests only): `live-dropped-only-at-start` lets go of the boundary the save
        // started at only (a save that passes the whole prompt again kept the old end live).
        let past: Vec<usize> =
            if crate::seeded::seeded("live-dropped-only-at-start") { vec![from] } else { (from..end).collect() };
        for b in past.into_iter().filter(|&b| b > 0) {
            self.drop_live(&mut st, &keys[b - 1]);
        }
        // The save's own window blocks behind its end that no live boundary covers.
        for (g, r) in ranges.iter().enumerate() {
            if self.is_window(g) {
                for j in r.clone() {
                    let gk = self.layout.group_key(g, &keys[j]);
                    if !st.covers.contains_key(&gk) {
                        self.mark(&mut st, g, gk);
                    }
                }
            }
        }
        self.prune(&mut st);
    }

    /// A query answered at boundary `b` of `keys`: the boundary is live (its window is in use).
    /// Its state checkpoint is in use too: a mark it kept from a break is cleared.
    pub(crate) fn after_query(&self, keys: &[ContentKey], b: usize) {
        if b == 0 {
            return;
        }
        for g in (0..self.cores.len()).filter(|&g| self.kind(g) == GroupKind::State) {
            for i in self.layout.needed(g, b) {
                self.cores[g].clear_cold(&self.layout.group_key(g, &keys[i]));
            }
        }
        // Seeded bug (tests only): `hybrid-query-not-live` leaves a query's boundary dead.
        if crate::seeded::seeded("hybrid-query-not-live") || !(0..self.cores.len()).any(|g| self.is_window(g)) {
            return;
        }
        let mut st = crate::sync::lock(&self.state);
        self.add_live(&mut st, keys, b);
    }

    /// Cold marks of group `g` counted now.
    pub(crate) fn cold_blocks(&self, g: usize) -> usize {
        self.cores[g].cold_blocks()
    }

    /// Drops what no longer names a resident block, once a table outgrows four times the
    /// groups' capacity (a live boundary whose block left lets its window blocks go).
    fn prune(&self, st: &mut State) {
        let cap: usize = self.cores.iter().map(|c| c.pool().capacity() as usize).sum::<usize>().max(1024);
        let resident = |g: usize, gk: &ContentKey| self.cores[g].find_block(gk).is_some();
        let any_group = |c: &ContentKey| (0..self.cores.len()).any(|g| resident(g, &self.layout.group_key(g, c)));
        if st.owner.len() > 4 * cap {
            st.owner.retain(|gk, _| (0..self.cores.len()).any(|g| resident(g, gk)));
        }
        if st.children.len() > 4 * cap || st.links > 4 * cap {
            st.children.retain(|c, next| {
                next.retain(|n| any_group(n));
                !next.is_empty() && any_group(c)
            });
            st.links = st.children.values().map(HashSet::len).sum();
        }
        if st.parent.len() > 4 * cap {
            st.parent.retain(|c, _| any_group(c));
        }
        if st.live.len() > 4 * cap {
            let gone: Vec<ContentKey> = st.live.keys().filter(|c| !any_group(c)).copied().collect();
            for c in gone {
                self.drop_live(st, &c);
            }
        }
        if st.covers.len() > 4 * cap {
            st.covers.retain(|gk, _| (0..self.cores.len()).any(|g| resident(g, gk)));
        }
        if st.pending.len() > cap {
            let excess: Vec<_> = st.pending.iter().take(st.pending.len() - cap).copied().collect();
            for e in excess {
                st.pending.remove(&e);
            }
        }
    }
}

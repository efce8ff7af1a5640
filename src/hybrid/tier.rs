//! A host tier for a hybrid layout: one [`HostTier`] per cache group, queries that answer the
//! longest prefix the model can use, and saves and restores that move every group's blocks in one
//! call.

use std::time::Duration;

use super::evict::GroupEviction;
use super::layout::{GroupKind, HybridLayout};
use crate::copy::{CopyBackend, WaitFor};
use crate::error::{CopyError, Error, GeometryError, TierError};
use crate::key::ContentKey;
use crate::sync::Arc;
use crate::tier::handle::CopyHandle;
use crate::tier::lease::Lease;
use crate::tier::{HostTier, Rank, SaveTicket, TierConfig};

/// The configuration of a [`HybridTier`]: the layout and one [`TierConfig`] per group, in group
/// order (each group has its own host pool, of its own slot size).
#[derive(Clone, Debug)]
pub struct HybridConfig {
    /// The layout.
    pub layout: HybridLayout,
    /// One tier configuration per group; `tiers[g].geometry` must be group `g`'s geometry.
    pub tiers: Vec<TierConfig>,
    /// Eviction across groups (default on): the blocks of the sliding-window and state groups
    /// that no restore can use (their full-attention prefix evicted, or behind the window of
    /// every live boundary) are evicted first in their groups (docs/design.md, "Eviction across
    /// cache groups"). Off: each group evicts by its policy alone.
    pub group_eviction: bool,
}

impl HybridConfig {
    /// `pool_bytes` of host memory split over the groups in proportion to their slot bytes, so
    /// every group's pool holds the same number of blocks (a group that keeps fewer blocks, a
    /// sliding window's, may be given less through `tiers`). Each group's tier has the defaults
    /// of [`TierConfig::new`].
    pub fn new(layout: HybridLayout, pool_bytes: u64) -> Self {
        let total: u64 = layout.groups().iter().map(|g| g.geometry.slot_bytes()).sum();
        let tiers = layout
            .groups()
            .iter()
            .map(|g| {
                let share = (pool_bytes as u128 * g.geometry.slot_bytes() as u128 / total as u128) as u64;
                TierConfig::new(g.geometry.clone(), share)
            })
            .collect();
        HybridConfig { layout, tiers, group_eviction: true }
    }

    /// This configuration with eviction across groups on or off (see
    /// [`HybridConfig::group_eviction`]).
    pub fn with_group_eviction(mut self, on: bool) -> Self {
        self.group_eviction = on;
        self
    }
}

/// A host tier for a hybrid model: one [`HostTier`] per cache group.
///
/// A prefix is usable at boundary `L` (in blocks) only when every group holds the blocks a
/// restore at `L` needs ([`HybridLayout::needed`]): all of `0..L` for full attention, the window's
/// last blocks for sliding-window attention, the checkpoint at `L` for recurrent state.
/// [`HybridTier::query`] answers the longest usable prefix and pins all of its blocks in every
/// group at once, so a restore never mixes groups of different prefixes, and a save becomes a hit
/// only when every group's blocks of a boundary are committed.
#[derive(Debug)]
pub struct HybridTier {
    layout: HybridLayout,
    tiers: Vec<HostTier>,
    eviction: Option<Arc<GroupEviction>>,
}

/// Pins on the blocks a restore at one boundary needs, in every group (from
/// [`HybridTier::query`]). Dropping it releases every pin; each group's lease allows the uses the
/// query asked for. A full-attention group's lease is on the group's whole ready prefix, which
/// may run past the boundary (a restore reads its first [`HybridLease::range`] blocks; the rest
/// are let go when the lease settles).
#[derive(Debug)]
#[must_use = "a hybrid lease dropped at once lets its blocks go: restore from it"]
pub struct HybridLease {
    boundary: usize,
    ranges: Vec<std::ops::Range<usize>>,
    leases: Vec<Lease>,
}

impl HybridLease {
    /// The usable prefix, in blocks (0: a miss).
    pub fn boundary(&self) -> usize {
        self.boundary
    }

    /// True for a miss.
    pub fn is_empty(&self) -> bool {
        self.boundary == 0
    }

    /// The block indices leased in group `group` (what a restore of that group writes, in order).
    ///
    /// # Panics
    /// If `group` is not below the number of groups.
    pub fn range(&self, group: usize) -> std::ops::Range<usize> {
        self.ranges[group].clone()
    }

    /// Group `group`'s lease (for inspection: sources, uses left).
    ///
    /// # Panics
    /// If `group` is not below the number of groups.
    pub fn group(&self, group: usize) -> &Lease {
        &self.leases[group]
    }

    /// Releases every group's pins now; true if any was still held.
    pub fn release(self) -> bool {
        self.leases.into_iter().fold(false, |any, l| l.release() | any)
    }
}

impl HybridTier {
    /// Makes one tier per group.
    ///
    /// # Errors
    /// [`Error::Tier`] with [`TierError::GeometryMismatch`] when the number of tier
    /// configurations is not the number of groups or a configuration's geometry is not its
    /// group's; the errors of [`HostTier::new`] (a group's pool smaller than one of its slots:
    /// [`crate::PoolError::TooSmall`]).
    pub fn new(config: HybridConfig) -> Result<Self, Error> {
        let HybridConfig { layout, tiers, group_eviction } = config;
        if tiers.len() != layout.groups().len() {
            return Err(Error::Tier(TierError::GeometryMismatch {
                backend: format!("{} tier configurations", tiers.len()),
                tier: format!("{} ({} cache groups)", layout.model(), layout.groups().len()),
            }));
        }
        for (t, g) in tiers.iter().zip(layout.groups()) {
            if t.geometry != g.geometry {
                return Err(Error::Tier(TierError::GeometryMismatch {
                    backend: t.geometry.model().to_string(),
                    tier: format!("{} group `{}`", g.geometry.model(), g.name),
                }));
            }
        }
        let refuse = |reason: String| Err(Error::Geometry(GeometryError::Groups { reason }));
        if let Some(g) = tiers.iter().zip(layout.groups()).find(|(t, _)| t.ssd.is_some()) {
            // The usable-prefix search looks at host blocks only; a group's SSD tier would be
            // asked (and promote) only for full-attention prefixes.
            return refuse(format!("cache group `{}` has an SSD tier: hybrid tiers keep host pools only", g.1.name));
        }
        let tiers = tiers
            .into_iter()
            .zip(layout.groups())
            .map(|(t, g)| {
                HostTier::new_adjusted(t, |core| match (group_eviction, g.kind) {
                    (false, _) => core,
                    // A full-attention group's evictions are followed; the others are marked.
                    (true, GroupKind::Full) => core.with_eviction_log(),
                    (true, _) => core.with_cold_marks(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        for (t, group) in tiers.iter().zip(layout.groups()) {
            // A restore at a boundary past the window needs the window's `ceil(W / T)` blocks at
            // once: a pool that cannot hold them never gives a hit there.
            let need = match group.kind {
                GroupKind::SlidingWindow { window_tokens } => {
                    (window_tokens as u64).div_ceil(layout.page_tokens() as u64) as usize
                }
                _ => 1,
            };
            if (t.capacity() as usize) < need {
                return refuse(format!(
                    "cache group `{}`'s pool holds {} blocks; its window needs {need} at once",
                    group.name,
                    t.capacity()
                ));
            }
        }
        let eviction = group_eviction
            .then(|| Arc::new(GroupEviction::new(layout.clone(), tiers.iter().map(|t| t.core().clone()).collect())));
        Ok(HybridTier { layout, tiers, eviction })
    }

    /// The layout.
    pub fn layout(&self) -> &HybridLayout {
        &self.layout
    }

    /// Group `group`'s tier (stats, hints, eviction, its own queries by group key).
    ///
    /// # Panics
    /// If `group` is not below the number of groups.
    pub fn group(&self, group: usize) -> &HostTier {
        &self.tiers[group]
    }

    /// Attaches one rank: `backends[g]` copies group `g`'s arenas.
    ///
    /// # Errors
    /// [`TierError::GeometryMismatch`] for a count other than the groups'; the errors of
    /// [`HostTier::attach`] (the ranks attached before the failing one are shut down).
    pub fn attach(&self, backends: Vec<Box<dyn CopyBackend>>) -> Result<HybridRank, TierError> {
        if backends.len() != self.tiers.len() {
            return Err(TierError::GeometryMismatch {
                backend: format!("{} backends", backends.len()),
                tier: format!("{} ({} cache groups)", self.layout.model(), self.tiers.len()),
            });
        }
        let mut ranks = Vec::with_capacity(backends.len());
        for (t, b) in self.tiers.iter().zip(backends) {
            match t.attach(b) {
                Ok(r) => ranks.push(r),
                Err(e) => {
                    for r in ranks {
                        let _ = r.shutdown(Duration::from_secs(5));
                    }
                    return Err(e);
                }
            }
        }
        Ok(HybridRank { layout: self.layout.clone(), ranks, eviction: self.eviction.clone() })
    }

    /// Every group's keys of `keys`, derived once per query: `[group][block]`.
    fn group_keys(&self, keys: &[ContentKey]) -> Vec<Vec<ContentKey>> {
        (0..self.tiers.len()).map(|g| keys.iter().map(|k| self.layout.group_key(g, k)).collect()).collect()
    }

    /// Whether a restore at `boundary` finds every group's needed blocks ready (no pins taken;
    /// the full-attention groups are already known to hold `0..boundary`).
    fn looks_usable(&self, gkeys: &[Vec<ContentKey>], boundary: usize) -> bool {
        (0..self.tiers.len())
            .filter(|&g| self.layout.groups()[g].kind != GroupKind::Full)
            .all(|g| self.layout.needed(g, boundary).all(|i| self.tiers[g].contains(&gkeys[g][i])))
    }

    /// [`HybridTier::query_shared`] with one use.
    pub fn query(&self, keys: &[ContentKey]) -> HybridLease {
        self.query_shared(keys, 1)
    }

    /// Pins the blocks of the longest prefix of `keys` (content keys of the layout's namespace,
    /// one per block) that the model can restore at, and returns a lease on them in every group
    /// with `uses` restores allowed. The boundary is the largest `L` such that every
    /// full-attention group holds blocks `0..L`, every sliding-window group the window before
    /// `L`, and every state group the checkpoint at `L`; a prefix whose state checkpoint is gone is
    /// not usable at that boundary even though its attention blocks are there.
    ///
    /// The full-attention prefixes are pinned first (those leases are the answer's for their
    /// groups); boundaries at or below the shortest are tried from the longest down, each one's
    /// other blocks looked up, then pinned together, the boundary taken only if every pin held (a
    /// block evicted between the look and the pin sends the search one boundary down). Each
    /// group's tier counts the hits and misses of its leases, as for its own queries.
    pub fn query_shared(&self, keys: &[ContentKey], uses: u32) -> HybridLease {
        // Seeded bug (tests only): `hybrid-attention-prefix-only` answers the longest attention
        // prefix, ignoring what the sliding-window and state groups hold.
        let attention_only = crate::seeded::seeded("hybrid-attention-prefix-only");
        let groups = self.layout.groups();
        if uses == 0 {
            // A lease with no use pins nothing: not a hit (as `HostTier::query_shared`'s is settled).
            return self.miss(vec![None; groups.len()], 0);
        }
        let gkeys = self.group_keys(keys);
        // One lease per full-attention group on its ready prefix: while they are held, `0..top`
        // stays in every such group. They become the answer's leases (a restore reads their first
        // `boundary` blocks), so each group's tier counts the query once.
        let mut top = keys.len();
        let mut full: Vec<Option<Lease>> = (0..self.tiers.len())
            .map(|g| {
                (groups[g].kind == GroupKind::Full).then(|| {
                    let l = self.tiers[g].query_shared(&gkeys[g], uses);
                    top = top.min(l.len());
                    l
                })
            })
            .collect();
        let mut boundary = top;
        while boundary > 0 {
            if attention_only || self.looks_usable(&gkeys, boundary) {
                if let Some(others) = self.pin_others(&gkeys, boundary, uses, attention_only) {
                    let mut ranges = Vec::with_capacity(groups.len());
                    let mut leases = Vec::with_capacity(groups.len());
                    for (g, other) in others.into_iter().enumerate() {
                        let skipped = attention_only && groups[g].kind != GroupKind::Full;
                        ranges.push(if skipped { 0..0 } else { self.layout.needed(g, boundary) });
                        leases.push(match full[g].take() {
                            Some(l) => l,
                            None => other.expect("a lease for every group that is not full attention"),
                        });
                    }
                    if let Some(e) = &self.eviction {
                        e.after_query(keys, boundary);
                    }
                    return HybridLease { boundary, ranges, leases };
                }
            }
            boundary -= 1;
        }
        self.miss(full, uses)
    }

    /// A miss: every group's lease settled. A full-attention group's prefix lease is let go and
    /// kept settled (so its tier counts the query once); the other groups get a settled lease.
    fn miss(&self, full: Vec<Option<Lease>>, uses: u32) -> HybridLease {
        let leases = full
            .into_iter()
            .enumerate()
            .map(|(g, l)| match l {
                Some(l) => {
                    let settled = l.clone();
                    let _ = l.release();
                    settled
                }
                None => self.tiers[g].query_shared(&[], uses.min(1)),
            })
            .collect();
        HybridLease { boundary: 0, ranges: vec![0..0; self.tiers.len()], leases }
    }

    /// Leases the needed blocks at `boundary` of every group that is not full attention, or
    /// `None` if one of them is no longer ready (evicted since the look; the pins taken are let
    /// go). Full-attention groups get `None` entries (their prefix leases serve).
    fn pin_others(
        &self,
        gkeys: &[Vec<ContentKey>],
        boundary: usize,
        uses: u32,
        attention_only: bool,
    ) -> Option<Vec<Option<Lease>>> {
        let mut leases = Vec::with_capacity(self.tiers.len());
        for (g, group) in self.layout.groups().iter().enumerate() {
            if group.kind == GroupKind::Full {
                leases.push(None);
                continue;
            }
            let range = if attention_only { 0..0 } else { self.layout.needed(g, boundary) };
            let lease = self.tiers[g].query_shared(&gkeys[g][range.clone()], uses);
            // Seeded bug (model checking only): `hybrid-pin-unchecked` takes the boundary from the
            // look alone, whether or not every pin held.
            if lease.len() < range.len() && !crate::seeded::seeded("hybrid-pin-unchecked") {
                return None;
            }
            // Seeded bug (tests only): `hybrid-lease-drops-state` lets the state groups' pins go
            // as soon as the boundary is decided.
            if group.kind == GroupKind::State && crate::seeded::seeded("hybrid-lease-drops-state") {
                let _ = lease.clone().release();
            }
            leases.push(Some(lease));
        }
        Some(leases)
    }

    /// The longest usable prefix of `keys`, in blocks, looked up without pinning (the answer may
    /// be stale by the time it is used: restore from [`HybridTier::query`]).
    pub fn usable_prefix(&self, keys: &[ContentKey]) -> usize {
        let gkeys = self.group_keys(keys);
        let mut top = keys.len();
        for (g, group) in self.layout.groups().iter().enumerate() {
            if group.kind == GroupKind::Full {
                // As a query's lease, the run ends at a repeated key.
                let mut seen = std::collections::HashSet::new();
                let run = gkeys[g].iter().take_while(|k| seen.insert(**k) && self.tiers[g].contains(k)).count();
                top = top.min(run);
            }
        }
        (1..=top).rev().find(|&b| self.looks_usable(&gkeys, b)).unwrap_or(0)
    }

    /// For saves made through each group's own [`Rank`] instead of [`HybridRank::save`] (the
    /// Python binding's, or an engine's that saves groups at different times): reads the
    /// full-attention groups' evictions so far and marks cold the other groups' blocks they left
    /// unusable (see [`HybridConfig::group_eviction`]). Call it before saving a sliding-window or
    /// state group's blocks, so they evict those first. Does nothing with group eviction off.
    pub fn settle_evictions(&self) {
        if let Some(e) = &self.eviction {
            e.settle();
        }
    }

    /// For saves made through each group's own [`Rank`]: tells eviction across groups that blocks
    /// `ranges[g]` of the prefix `keys` (content keys of the layout's namespace, one per block)
    /// were submitted in group `g` (what [`HybridRank::save`] records itself): the prompt's
    /// blocks, the boundary it now ends at (its window in use), the window blocks it left behind.
    /// Call it once per hybrid save, after every group's submission; a group given nothing (or
    /// whose save failed) has an empty range. Does nothing with group eviction off.
    ///
    /// # Errors
    /// [`TierError::GeometryMismatch`] for a count of `ranges` other than the groups';
    /// [`TierError::LengthMismatch`] for a range that runs past `keys` (nothing recorded).
    pub fn record_save(&self, keys: &[ContentKey], ranges: &[std::ops::Range<usize>]) -> Result<(), TierError> {
        if ranges.len() != self.tiers.len() {
            return Err(TierError::GeometryMismatch {
                backend: format!("block ranges for {} cache groups", ranges.len()),
                tier: format!("{} ({} cache groups)", self.layout.model(), self.tiers.len()),
            });
        }
        if let Some(r) = ranges.iter().find(|r| r.end > keys.len() || r.start > r.end) {
            return Err(TierError::LengthMismatch { keys: keys.len(), pages: r.end });
        }
        if let Some(e) = &self.eviction {
            e.after_save(keys, ranges);
        }
        Ok(())
    }

    /// Blocks of group `group` marked cold now (eviction across cache groups: the first victims of
    /// their group; 0 with group eviction off and for full-attention groups). For operators and
    /// tests.
    ///
    /// # Panics
    /// If `group` is not below the number of groups.
    pub fn cold_blocks(&self, group: usize) -> usize {
        assert!(group < self.tiers.len(), "cache group {group} of {}", self.tiers.len());
        self.eviction.as_ref().map_or(0, |e| e.cold_blocks(group))
    }

    /// Stops every group's tier (see [`HostTier::shutdown`]).
    pub fn shutdown(&self) {
        for t in &self.tiers {
            t.shutdown();
        }
    }
}

/// The block ranges of `pages`.
fn ranges_of(pages: &[GroupPages]) -> Vec<std::ops::Range<usize>> {
    pages.iter().map(|p| p.first_block..p.first_block + p.pages.len()).collect()
}

/// GPU pages of one group in a [`HybridRank::save`]: `pages[i]` holds block `first_block + i` of
/// the prefix (for a state group: the checkpoint at boundary `first_block + i + 1`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupPages {
    /// Index of the first block the pages hold.
    pub first_block: usize,
    /// GPU page ids in the group's arenas, one per block.
    pub pages: Vec<u64>,
}

impl GroupPages {
    /// Pages for blocks `first_block..first_block + pages.len()`.
    pub fn new(first_block: usize, pages: Vec<u64>) -> Self {
        GroupPages { first_block, pages }
    }

    /// Nothing of this group.
    pub fn none() -> Self {
        GroupPages::default()
    }
}

/// One rank of a [`HybridTier`]: a [`Rank`] per group.
#[derive(Debug)]
pub struct HybridRank {
    layout: HybridLayout,
    ranks: Vec<Rank>,
    eviction: Option<Arc<GroupEviction>>,
}

/// What a [`HybridRank::save`] submitted: one ticket per group (`None` for a group given no
/// pages).
#[derive(Debug)]
pub struct HybridSave {
    /// Per group, in group order.
    pub tickets: Vec<Option<SaveTicket>>,
}

impl HybridSave {
    /// Waits for every group's copy; the first error, after all have finished.
    ///
    /// # Errors
    /// The first group's copy error, in group order.
    pub fn wait(&self) -> Result<(), TierError> {
        let results: Vec<_> = self.tickets.iter().flatten().map(|t| t.handle.wait()).collect();
        results.into_iter().collect()
    }
}

/// A restore of every group of a [`HybridLease`], one handle per group given pages.
#[derive(Debug)]
pub struct HybridRestore {
    /// Per group, in group order (`None` for a group with nothing to restore).
    pub handles: Vec<Option<CopyHandle>>,
}

impl HybridRestore {
    /// Waits for every group's copy; the first error, after all have finished (the GPU pages of
    /// every group may be reused once this returns, even on error).
    ///
    /// # Errors
    /// The first group's copy error, in group order.
    pub fn wait(&self) -> Result<(), TierError> {
        let results: Vec<_> = self.handles.iter().flatten().map(|h| h.wait()).collect();
        results.into_iter().collect()
    }
}

impl HybridRank {
    /// Group `group`'s rank.
    ///
    /// # Panics
    /// If `group` is not below the number of groups.
    pub fn group(&self, group: usize) -> &Rank {
        &self.ranks[group]
    }

    /// Page ids of group `g` below its arenas' page count and, for a restore (`writes`), none
    /// repeated (what each group's rank would refuse), checked for every group before any copy
    /// is submitted.
    fn check_pages(&self, g: usize, pages: &[u64], writes: bool) -> Result<(), TierError> {
        let n = self.ranks[g].gpu_pages();
        if let Some(&page) = pages.iter().find(|&&p| p >= n) {
            return Err(TierError::Copy(CopyError::PageOutOfRange { page, pages: n }));
        }
        let mut seen = std::collections::HashSet::with_capacity(pages.len());
        if let Some(&id) = pages.iter().find(|&&p| writes && !seen.insert(p)) {
            return Err(TierError::Copy(CopyError::DuplicateDestination { what: "GPU page", id }));
        }
        Ok(())
    }

    fn check_count(&self, given: usize) -> Result<(), TierError> {
        if given != self.ranks.len() {
            return Err(TierError::GeometryMismatch {
                backend: format!("pages for {given} cache groups"),
                tier: format!("{} ({} cache groups)", self.layout.model(), self.ranks.len()),
            });
        }
        Ok(())
    }

    /// Saves a prefix's blocks in every group (GPU -> host, one batch per group, after `wait`):
    /// `keys` are the prefix's content keys (layout namespace, one per block), `pages[g]` the GPU
    /// pages of group `g` and the blocks they hold. Each group's blocks are saved under their
    /// group keys as [`Rank::save`] does (resident ones refreshed and skipped).
    ///
    /// Every group's run of blocks and page ids are checked before any copy starts. A boundary
    /// becomes a hit only
    /// when every group's blocks it needs are committed; if one group's save fails, the others'
    /// blocks stay (visible in their groups, not usable at that boundary until the missing ones
    /// are saved, and evictable like any other).
    ///
    /// # Errors
    /// [`TierError::GeometryMismatch`] for a count of `pages` other than the groups';
    /// [`TierError::LengthMismatch`] for a group whose blocks run past `keys`, or
    /// [`TierError::Copy`] with [`CopyError::PageOutOfRange`] for a page id outside a group's
    /// arenas (nothing saved in any group); the errors of [`Rank::save`] for the first group that
    /// fails otherwise (a full pool, shutdown, the backend: the groups before it were submitted,
    /// their copies finish, and this call waits for them before returning).
    pub fn save(&self, keys: &[ContentKey], pages: &[GroupPages], wait: WaitFor) -> Result<HybridSave, TierError> {
        self.check_count(pages.len())?;
        for (g, p) in pages.iter().enumerate() {
            if p.first_block.checked_add(p.pages.len()).is_none_or(|end| end > keys.len()) {
                return Err(TierError::LengthMismatch {
                    keys: keys.len(),
                    pages: p.first_block.saturating_add(p.pages.len()),
                });
            }
            self.check_pages(g, &p.pages, false)?;
        }
        let mut tickets = Vec::with_capacity(pages.len());
        for (g, p) in pages.iter().enumerate() {
            if p.pages.is_empty() {
                tickets.push(None);
                continue;
            }
            let gkeys: Vec<_> = keys[p.first_block..p.first_block + p.pages.len()]
                .iter()
                .map(|k| self.layout.group_key(g, k))
                .collect();
            if let Some(e) = &self.eviction {
                e.before_group_save(g);
            }
            // A full-attention group's blocks are one prompt's chain from `first_block` (its
            // policy and chain-aware ranking see the depth and the parent); the other groups'
            // blocks do not continue each other (a window block does not need the one before it
            // for every boundary it serves, a checkpoint needs none).
            let opts = match self.layout.groups()[g].kind {
                GroupKind::Full => {
                    let o = crate::tier::SaveOptions::new().prefix_depth(p.first_block as u32);
                    match p.first_block.checked_sub(1) {
                        Some(i) => o.parent(self.layout.group_key(g, &keys[i])),
                        None => o,
                    }
                }
                _ => crate::tier::SaveOptions::new(),
            };
            match self.ranks[g].save_with(&gkeys, &p.pages, wait, opts) {
                Ok(t) => tickets.push(Some(t)),
                Err(err) => {
                    let _ = HybridSave { tickets }.wait();
                    if let Some(e) = &self.eviction {
                        // What the groups before this one brought is recorded as saved.
                        let mut done = ranges_of(&pages[..g]);
                        done.resize(pages.len(), 0..0);
                        e.after_save(keys, &done);
                    }
                    return Err(err);
                }
            }
        }
        if let Some(e) = &self.eviction {
            e.after_save(keys, &ranges_of(pages));
        }
        Ok(HybridSave { tickets })
    }

    /// Restores every group's leased blocks (host -> GPU, one batch per group, after `wait`):
    /// `pages[g][i]` receives block `lease.range(g).start + i` of group `g`. A group given an empty
    /// page list is not restored (its lease keeps its use).
    ///
    /// Checked for every group before any copy is submitted (an error then restores nothing and
    /// every group's lease keeps its use, so a retry with good pages is served): the lease's
    /// group count, each group's page count against its range, the lease still live, page ids
    /// inside the group's arenas and none repeated. An error of a group's submission after that
    /// (its rank shutting down, a pin count at its limit, the backend) is returned after the
    /// groups already submitted have finished: their pages hold their blocks, their leases' uses
    /// are spent, and the lease as a whole cannot be restored again: query again, or prefill.
    ///
    /// # Errors
    /// [`TierError::ForeignLease`] for a lease of a layout with another number of groups;
    /// [`TierError::GeometryMismatch`] for a count of `pages` other than the groups';
    /// [`TierError::LeaseTooShort`] for a group given more pages than its range holds;
    /// [`TierError::LeaseExpired`] or [`TierError::LeaseSettled`] for a group lease that can no
    /// longer restore; [`TierError::Copy`] with [`CopyError::PageOutOfRange`] or
    /// [`CopyError::DuplicateDestination`]; the errors of [`Rank::restore`] for the first group
    /// whose submission fails.
    pub fn restore(&self, lease: &HybridLease, pages: &[Vec<u64>], wait: WaitFor) -> Result<HybridRestore, TierError> {
        if lease.ranges.len() != self.ranks.len() {
            return Err(TierError::ForeignLease);
        }
        self.check_count(pages.len())?;
        for (g, p) in pages.iter().enumerate() {
            if p.len() > lease.ranges[g].len() {
                return Err(TierError::LeaseTooShort { asked: p.len(), held: lease.ranges[g].len() });
            }
            if !p.is_empty() {
                if lease.leases[g].is_expired() {
                    return Err(TierError::LeaseExpired);
                }
                if lease.leases[g].is_settled() {
                    return Err(TierError::LeaseSettled);
                }
            }
            // Seeded bug (tests only): `hybrid-restore-unchecked` leaves page ids to each group's
            // rank, so a bad page in a later group is found after earlier groups were restored.
            if !crate::seeded::seeded("hybrid-restore-unchecked") {
                self.check_pages(g, p, true)?;
            }
        }
        let mut handles = Vec::with_capacity(pages.len());
        for (g, p) in pages.iter().enumerate() {
            if p.is_empty() {
                handles.push(None);
                continue;
            }
            match self.ranks[g].restore(&lease.leases[g], p, wait) {
                Ok(h) => handles.push(Some(h)),
                Err(e) => {
                    let _ = HybridRestore { handles }.wait();
                    return Err(e);
                }
            }
        }
        Ok(HybridRestore { handles })
    }

    /// Waits until no group's rank has a copy in flight (see [`Rank::drain`]).
    ///
    /// # Errors
    /// [`TierError::DrainTimeout`] from the first group still busy at the deadline.
    pub fn drain(&self, timeout: Duration) -> Result<(), TierError> {
        self.ranks.iter().try_for_each(|r| r.drain(timeout))
    }
}

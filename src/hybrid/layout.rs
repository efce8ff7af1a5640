//! The layout of a hybrid model's cache: named cache groups, each with its own arenas, page size
//! and page ids, and the rule saying which of a group's blocks a restore at a boundary needs.

use std::ops::Range;

use crate::error::GeometryError;
use crate::geometry::Geometry;
use crate::key::{ContentKey, Namespace};

/// What a cache group holds, and so which of its blocks a restore of a prefix needs.
///
/// Blocks are numbered along the prefix: block `i` covers tokens `[i * T, (i + 1) * T)` for the
/// layout's page size `T` ([`HybridLayout::page_tokens`]); a *boundary* `L` (in blocks) is the
/// position `L * T`, where a restore may start the suffix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum GroupKind {
    /// Full attention: a restore at boundary `L` needs every block `0..L`.
    Full,
    /// Sliding-window attention over the last `window_tokens` tokens: a restore at boundary `L`
    /// needs the blocks holding tokens `[L * T - window_tokens, L * T)` (clamped at 0), that is
    /// blocks `(L * T - window_tokens) / T .. L`; the blocks before them have left the window.
    SlidingWindow {
        /// Tokens a layer of the group attends back over (the model config's `sliding_window`).
        window_tokens: u32,
    },
    /// Recurrent state (linear attention, Mamba): one fixed-size *checkpoint* of the request's
    /// state per saved boundary, stored as the block of the boundary's last block (block `L - 1`
    /// is the state after token `L * T - 1`). A restore at boundary `L` needs that one block; a
    /// boundary with no checkpoint is not a place to restore at.
    State,
}

impl GroupKind {
    fn tag(&self) -> String {
        match self {
            GroupKind::Full => "full".into(),
            GroupKind::SlidingWindow { window_tokens } => format!("sliding:{window_tokens}"),
            GroupKind::State => "state".into(),
        }
    }
}

/// One cache group: a name, what it holds, and its own block layout (arenas, page bytes, page
/// ids). A group's block is one page id taken across its arenas, as for a plain [`Geometry`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct CacheGroup {
    /// Name, unique within the layout (e.g. `global`, `local`, `ssm`).
    pub name: String,
    /// What the group holds.
    pub kind: GroupKind,
    /// The group's arenas and host slot layout; its `page_tokens` must be the layout's.
    pub geometry: Geometry,
}

impl CacheGroup {
    /// A group named `name` of kind `kind` over `geometry`.
    pub fn new(name: impl Into<String>, kind: GroupKind, geometry: Geometry) -> Self {
        CacheGroup { name: name.into(), kind, geometry }
    }
}

/// A validated hybrid layout: the cache groups of one model, the namespace they share, and each
/// group's own key space.
///
/// Engines derive a block's **content key** once, in [`HybridLayout::namespace`] (typically with
/// [`Namespace::chain`]); [`HybridLayout::group_key`] turns it into the key of the block in one
/// group, so one prefix has distinct keys in every group and no two layouts share keys.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct HybridLayout {
    model: String,
    page_tokens: u32,
    groups: Vec<CacheGroup>,
    #[cfg_attr(feature = "serde", serde(skip))]
    namespace: Namespace,
    #[cfg_attr(feature = "serde", serde(skip))]
    group_namespaces: Vec<Namespace>,
}

/// Largest number of groups in a layout.
pub const MAX_GROUPS: usize = 16;

impl HybridLayout {
    /// Validates `groups` and derives the namespace: `XXH3-128` of a canonical description of the
    /// model name, the page size, and each group's name, kind (with its window) and geometry
    /// namespace, in group order.
    ///
    /// # Errors
    /// [`GeometryError::Groups`] for an empty model name, no groups or more than [`MAX_GROUPS`],
    /// an empty or repeated group name, groups whose `page_tokens` differ, a sliding window of 0
    /// tokens, or no group of attention (a layout of state groups only has no prefix to restore).
    pub fn new(model: impl Into<String>, groups: Vec<CacheGroup>) -> Result<Self, GeometryError> {
        let model = model.into();
        let bad = |reason: String| Err(GeometryError::Groups { reason });
        if model.is_empty() {
            return bad("the model name is empty".into());
        }
        if groups.is_empty() || groups.len() > MAX_GROUPS {
            return bad(format!("{} cache groups; a layout has 1 to {MAX_GROUPS}", groups.len()));
        }
        let page_tokens = groups[0].geometry.page_tokens();
        for (i, g) in groups.iter().enumerate() {
            if g.name.is_empty() {
                return bad(format!("cache group {i} has an empty name"));
            }
            if groups[..i].iter().any(|h| h.name == g.name) {
                return bad(format!("cache group name `{}` is used twice", g.name));
            }
            if g.geometry.page_tokens() != page_tokens {
                return bad(format!(
                    "cache group `{}` pages {} tokens but `{}` pages {page_tokens}: every group's block must cover \
                     the same tokens",
                    g.name,
                    g.geometry.page_tokens(),
                    groups[0].name
                ));
            }
            if g.kind == (GroupKind::SlidingWindow { window_tokens: 0 }) {
                return bad(format!("cache group `{}` has a sliding window of 0 tokens", g.name));
            }
        }
        if groups.iter().all(|g| g.kind == GroupKind::State) {
            return bad("every cache group holds recurrent state: at least one group must be attention".into());
        }
        let mut desc = format!("kvtier.hybrid.v1|{model}|{page_tokens}");
        for g in &groups {
            let ns = g.geometry.namespace();
            desc.push_str(&format!("|{}:{}:", g.name, g.kind.tag()));
            for b in ns.as_bytes() {
                desc.push_str(&format!("{b:02x}"));
            }
        }
        let namespace = Namespace::from_description(desc.as_bytes());
        let group_namespaces = groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let mut d = namespace.as_bytes().to_vec();
                d.extend_from_slice(format!("|group {i} {}", g.name).as_bytes());
                Namespace::from_description(&d)
            })
            .collect();
        Ok(HybridLayout { model, page_tokens, groups, namespace, group_namespaces })
    }

    /// The model name.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Tokens per block, the same in every group.
    pub fn page_tokens(&self) -> u32 {
        self.page_tokens
    }

    /// The groups, in the order given.
    pub fn groups(&self) -> &[CacheGroup] {
        &self.groups
    }

    /// The namespace engines derive content keys in (it names every group's layout).
    pub fn namespace(&self) -> Namespace {
        self.namespace
    }

    /// The key of block `key` (a content key of [`HybridLayout::namespace`]) in group `group`:
    /// `XXH3-128(group namespace || key)`, the group namespace being derived from the layout's
    /// namespace, the group's index and its name.
    ///
    /// # Panics
    /// If `group` is not below the number of groups (a caller's indexing bug).
    pub fn group_key(&self, group: usize, key: &ContentKey) -> ContentKey {
        self.group_namespaces[group].key(&key.0)
    }

    /// The blocks of group `group` that a restore at boundary `boundary` (in blocks) needs, as a
    /// range of block indices (see [`GroupKind`]); empty for boundary 0.
    ///
    /// # Panics
    /// If `group` is not below the number of groups.
    pub fn needed(&self, group: usize, boundary: usize) -> Range<usize> {
        if boundary == 0 {
            return 0..0;
        }
        match self.groups[group].kind {
            GroupKind::Full => 0..boundary,
            GroupKind::SlidingWindow { window_tokens } => {
                // In u128: `boundary * T` of any `usize` boundary fits.
                let t = self.page_tokens as u128;
                let first = ((boundary as u128 * t).saturating_sub(window_tokens as u128) / t) as u64;
                // Seeded bug (tests only): `sliding-window-short` leaves out the window's oldest
                // block (the one only partly inside the window).
                let first =
                    first + u64::from(crate::seeded::seeded("sliding-window-short") && first + 1 < boundary as u64);
                first as usize..boundary
            }
            GroupKind::State => boundary - 1..boundary,
        }
    }

    /// Bytes a restore at boundary `boundary` moves, over every group: the sum of each group's
    /// needed blocks times its slot bytes (saturating at `u64::MAX`).
    pub fn restore_bytes(&self, boundary: usize) -> u64 {
        (0..self.groups.len())
            .map(|g| (self.needed(g, boundary).len() as u64).saturating_mul(self.groups[g].geometry.slot_bytes()))
            .fold(0u64, u64::saturating_add)
    }

    /// Bytes the same restore moves in a layout without groups, where every attention layer is
    /// full attention: `boundary` blocks of every full and sliding-window group, and one
    /// checkpoint of every state group (recurrent state has no per-token pages to move).
    pub fn all_layers_bytes(&self, boundary: usize) -> u64 {
        self.groups
            .iter()
            .map(|g| match g.kind {
                GroupKind::State if boundary > 0 => g.geometry.slot_bytes(),
                GroupKind::State => 0,
                _ => (boundary as u64).saturating_mul(g.geometry.slot_bytes()),
            })
            .fold(0u64, u64::saturating_add)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::geometry::ArenaSpec;

    fn geo(tokens: u32, bytes: u64) -> Geometry {
        Geometry::new("m", tokens, vec![ArenaSpec::packed("a", bytes, 4)]).unwrap()
    }

    fn two(window: u32) -> HybridLayout {
        HybridLayout::new(
            "m",
            vec![
                CacheGroup::new("full", GroupKind::Full, geo(16, 1024)),
                CacheGroup::new("local", GroupKind::SlidingWindow { window_tokens: window }, geo(16, 512)),
                CacheGroup::new("ssm", GroupKind::State, geo(16, 4096)),
            ],
        )
        .unwrap()
    }

    #[test]
    fn each_kind_needs_its_own_blocks_at_a_boundary() {
        let l = two(40);
        assert_eq!(l.needed(0, 5), 0..5);
        assert_eq!(l.needed(1, 5), 2..5, "tokens 40..80 lie in blocks 2, 3 and 4");
        assert_eq!(l.needed(1, 2), 0..2, "a window longer than the prefix needs all of it");
        assert_eq!(two(32).needed(1, 5), 3..5, "a window of whole blocks needs exactly them");
        assert_eq!(l.needed(2, 5), 4..5, "the checkpoint at 5 is block 4's");
        for g in 0..3 {
            assert_eq!(l.needed(g, 0), 0..0);
        }
        // 5 full blocks of 1 KiB, 3 window blocks of 512 B, one checkpoint of 4 KiB.
        assert_eq!(l.restore_bytes(5), 5 * 1024 + 3 * 512 + 4096);
        assert_eq!(l.all_layers_bytes(5), 5 * (1024 + 512) + 4096);
    }

    #[test]
    fn keys_differ_per_group_and_per_layout() {
        let (a, b) = (two(32), two(48));
        assert_ne!(a.namespace(), b.namespace(), "the window enters the namespace");
        let k = a.namespace().chain(None, &[1, 2, 3]);
        let keys: Vec<_> = (0..3).map(|g| a.group_key(g, &k)).collect();
        assert!(keys[0] != keys[1] && keys[1] != keys[2] && keys[0] != keys[2]);
        assert_ne!(a.group_key(0, &k), b.group_key(0, &k));
        assert_eq!(a.group_key(1, &k), two(32).group_key(1, &k), "the same layout gives the same keys");
    }

    #[test]
    fn bad_layouts_are_refused_with_the_reason() {
        let reason = |r: Result<HybridLayout, GeometryError>| match r {
            Err(GeometryError::Groups { reason }) => reason,
            other => panic!("expected a groups error, got {other:?}"),
        };
        let full = || CacheGroup::new("full", GroupKind::Full, geo(16, 1024));
        assert!(reason(HybridLayout::new("m", vec![])).contains("0 cache groups"));
        assert!(reason(HybridLayout::new("", vec![full()])).contains("model name"));
        assert!(reason(HybridLayout::new("m", vec![full(), full()])).contains("`full` is used twice"));
        let other_page = CacheGroup::new("local", GroupKind::SlidingWindow { window_tokens: 8 }, geo(32, 512));
        assert!(reason(HybridLayout::new("m", vec![full(), other_page])).contains("pages 32 tokens"));
        let zero = CacheGroup::new("local", GroupKind::SlidingWindow { window_tokens: 0 }, geo(16, 512));
        assert!(reason(HybridLayout::new("m", vec![full(), zero])).contains("0 tokens"));
        let ssm = CacheGroup::new("ssm", GroupKind::State, geo(16, 512));
        assert!(reason(HybridLayout::new("m", vec![ssm])).contains("at least one group must be attention"));
        let many = (0..=MAX_GROUPS).map(|i| CacheGroup::new(format!("g{i}"), GroupKind::Full, geo(16, 64))).collect();
        assert!(reason(HybridLayout::new("m", many)).contains("17 cache groups"));
    }
}

//! Layer-wise copies: a batch moved one group of layers at a time, with a readiness per group.
//!
//! A restore that the engine consumes layer by layer (the suffix's layer `l` needs only layer `l`'s
//! restored pages) moves the batch in **layer order**: every block's chunks of group 0, then every
//! block's chunks of group 1, and so on, as one submission. After each group the backend signals
//! that group's readiness ([`LayerReadiness`]): a CUDA event per group that the engine's stream
//! waits on just before the group's first layer, so the copy of later layers runs under the
//! compute of earlier ones. A layer-wise save is the mirror: the copy of group `g` waits for the
//! engine's event recorded after the group's last layer was written, so the save runs behind the
//! prefill instead of after it.
//!
//! Groups are runs of consecutive layers ([`LayerGroups::new`]); since a layer's arenas are
//! neighbours in arena order ([`Geometry::with_layers`]), a group is one contiguous range of arenas
//! and of every host slot.

use super::{Completion, CopyBackend, CopyPair, Direction, WaitFor};
use crate::error::CopyError;
use crate::geometry::Geometry;
use std::ops::Range;

/// A partition of a geometry's arenas into groups of consecutive layers, in layer (= arena)
/// order: the unit of readiness of a layer-wise copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerGroups {
    /// Arena range of each group.
    arenas: Vec<Range<usize>>,
    /// Layer range of each group, as positions among the geometry's distinct layers (0-based).
    layers: Vec<Range<u32>>,
    /// Distinct layers of the geometry.
    layer_count: u32,
}

impl LayerGroups {
    /// `groups` groups of consecutive layers of `geometry`, as even as possible (group `g` holds
    /// layers `g * L / G .. (g + 1) * L / G` for `L` layers; `G = min(groups, L)`). Layers are
    /// counted as positions among the geometry's distinct layer ids ([`Geometry::layers`]), so a
    /// geometry whose ids are `[4, 4, 9]` has layers 0 and 1. A geometry without layer ids has one
    /// layer: one group.
    ///
    /// # Errors
    /// [`CopyError::BadArgument`] for `groups == 0`.
    pub fn new(geometry: &Geometry, groups: u32) -> Result<Self, CopyError> {
        if groups == 0 {
            return Err(CopyError::BadArgument { name: "layer groups", value: 0, allowed: "at least 1" });
        }
        let ids = geometry.layers();
        // Position of each arena's layer among the distinct layers.
        let mut pos = Vec::with_capacity(ids.len());
        let mut p = 0u32;
        for (i, &l) in ids.iter().enumerate() {
            if i > 0 && l != ids[i - 1] {
                p += 1;
            }
            pos.push(p);
        }
        let layer_count = p + 1;
        let g = groups.min(layer_count);
        let layers: Vec<Range<u32>> = (0..g)
            .map(|k| {
                let lo = (k as u64 * layer_count as u64 / g as u64) as u32;
                let hi = ((k as u64 + 1) * layer_count as u64 / g as u64) as u32;
                lo..hi
            })
            .collect();
        let arenas = layers
            .iter()
            .map(|r| {
                let a = pos.partition_point(|&x| x < r.start);
                let b = pos.partition_point(|&x| x < r.end);
                a..b
            })
            .collect();
        Ok(LayerGroups { arenas, layers, layer_count })
    }

    /// Number of groups (at least 1).
    pub fn len(&self) -> usize {
        self.arenas.len()
    }

    /// Always false: there is at least one group.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Distinct layers of the geometry the groups were made for.
    pub fn layer_count(&self) -> u32 {
        self.layer_count
    }

    /// The arenas of group `g` (a non-empty range, in arena order). Panics if `g >= len()`.
    pub fn arenas(&self, g: usize) -> Range<usize> {
        self.arenas[g].clone()
    }

    /// The layers (0-based positions) of group `g`. Panics if `g >= len()`.
    pub fn layers(&self, g: usize) -> Range<u32> {
        self.layers[g].clone()
    }

    /// The group holding layer `layer` (0-based position among the distinct layers).
    ///
    /// # Errors
    /// [`CopyError::NoSuchLayer`] for `layer >= layer_count()`.
    pub fn group_of_layer(&self, layer: u32) -> Result<usize, CopyError> {
        if layer >= self.layer_count {
            return Err(CopyError::NoSuchLayer { layer, layers: self.layer_count });
        }
        Ok(self.layers.partition_point(|r| r.end <= layer))
    }

    /// Checks that the groups tile the `arenas` arenas of a backend's geometry.
    ///
    /// # Errors
    /// [`CopyError::LayerGroupsMismatch`] if they do not (groups made for another geometry).
    pub fn check(&self, arenas: usize) -> Result<(), CopyError> {
        let tiles = self.arenas.first().is_some_and(|r| r.start == 0)
            && self.arenas.windows(2).all(|w| w[0].end == w[1].start)
            && self.arenas.iter().all(|r| r.start < r.end)
            && self.arenas.last().is_some_and(|r| r.end == arenas);
        if tiles {
            Ok(())
        } else {
            Err(CopyError::LayerGroupsMismatch { groups: self.arenas.clone(), arenas })
        }
    }

    /// Checks a list of per-group waits: one (before everything) or one per group.
    ///
    /// # Errors
    /// [`CopyError::WaitCount`] for another count.
    pub fn check_waits(&self, waits: &[WaitFor]) -> Result<(), CopyError> {
        if waits.len() == 1 || waits.len() == self.len() {
            Ok(())
        } else {
            Err(CopyError::WaitCount { waits: waits.len(), groups: self.len() })
        }
    }
}

/// The per-group readiness of a layer-wise copy (see [`Completion::layer_readiness`]).
///
/// Ordering guarantee: group `g` is ready only after every byte of groups `0..=g` of every block
/// of the batch is in place (the copy order is the layer order), so waiting for group `g` also
/// covers the earlier groups. A failed copy also makes its groups "ready": check the copy's
/// outcome before trusting the pages.
pub trait LayerReadiness: Send + Sync {
    /// Number of groups.
    fn groups(&self) -> usize;
    /// The raw `CUevent` recorded after group `g`'s last byte, for an engine that orders its own
    /// work with its CUDA binding; `None` for a backend without device events. Valid while this
    /// value lives. Panics if `g >= groups()`.
    fn cuda_event(&self, g: usize) -> Option<u64>;
    /// Makes work queued on the raw `CUstream` `stream` after this call wait for group `g`
    /// (`cuStreamWaitEvent`, no host synchronisation); a backend without device events blocks
    /// the calling thread until group `g` has been copied instead. Panics if `g >= groups()`.
    ///
    /// # Errors
    /// Driver errors; the host backend's copy failure.
    fn stream_wait(&self, g: usize, stream: u64) -> Result<(), CopyError>;
    /// True once group `g` has been copied (never blocks). Panics if `g >= groups()`.
    ///
    /// # Errors
    /// Driver errors.
    fn is_ready(&self, g: usize) -> Result<bool, CopyError>;
}

/// Layer-wise submission, implemented by backends that can move a batch group by group.
///
/// # Safety contract
/// As for [`CopyBackend::save`] / [`CopyBackend::restore`]: the caller owns the batch's slots and
/// pages until the completion's `wait` returns.
pub trait LayerCopy {
    /// Moves `batch` in direction `dir` one layer group at a time, in group order, as one
    /// submission. `waits` is one [`WaitFor`] before the whole copy, or one per group: group `g`'s
    /// copy of GPU pages (a save's read, a restore's write) starts after `waits[g]` and after the
    /// earlier groups' waits. For a save, the engine records an event after each layer group's
    /// last layer and passes them here; each must have been recorded (`cuEventRecord` called)
    /// before this call, since a CUDA wait takes an event's state when it is queued.
    ///
    /// The completion's [`Completion::layer_readiness`] gives each group's readiness.
    ///
    /// # Safety
    /// See the trait-level contract.
    ///
    /// # Errors
    /// As [`CopyBackend::save`]; [`CopyError::LayerGroupsMismatch`] / [`CopyError::WaitCount`] for groups that do not tile the arenas or
    /// a wait count other than 1 or `groups.len()`.
    unsafe fn copy_layers(
        &self,
        dir: Direction,
        batch: &[CopyPair],
        groups: &LayerGroups,
        waits: &[WaitFor],
    ) -> Result<Box<dyn Completion>, CopyError>;
}

/// Moves `batch` layer-wise through `backend` if it supports it ([`CopyBackend::layer_copy`]),
/// else as one whole-block copy after `waits`' last entry (which covers all when the events were
/// recorded in layer order on one stream), whose completion has no per-group readiness (every
/// group is ready when the copy is).
///
/// # Safety
/// As [`LayerCopy::copy_layers`].
///
/// # Errors
/// As [`LayerCopy::copy_layers`].
pub unsafe fn copy_layers(
    backend: &dyn CopyBackend,
    dir: Direction,
    batch: &[CopyPair],
    groups: &LayerGroups,
    waits: &[WaitFor],
) -> Result<Box<dyn Completion>, CopyError> {
    groups.check(backend.geometry().arenas().len())?;
    groups.check_waits(waits)?;
    match backend.layer_copy() {
        // SAFETY: forwarded contract.
        Some(l) => unsafe { l.copy_layers(dir, batch, groups, waits) },
        None => {
            let wait = *waits.last().expect("checked: at least one wait");
            // SAFETY: forwarded contract.
            unsafe {
                match dir {
                    Direction::Save => backend.save(batch, wait),
                    Direction::Restore => backend.restore(batch, wait),
                }
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn groups_split_layers_evenly_and_map_arenas() {
        let g = Geometry::preset("glm52", 4).unwrap();
        let all = LayerGroups::new(&g, 78).unwrap();
        assert_eq!((all.len(), all.layer_count()), (78, 78));
        // Layer 0 has mla.L0 and indexk.L0; layer 3 only mla.L3.
        assert_eq!(all.arenas(0), 0..2);
        assert_eq!(all.arenas(3), 6..7);
        assert_eq!(all.arenas(77), 98..99);
        all.check(99).unwrap();
        let eight = LayerGroups::new(&g, 8).unwrap();
        assert_eq!(eight.len(), 8);
        assert_eq!(eight.layers(0), 0..9);
        assert_eq!(eight.layers(7), 68..78);
        eight.check(99).unwrap();
        assert_eq!(eight.group_of_layer(8).unwrap(), 0);
        assert_eq!(eight.group_of_layer(9).unwrap(), 1);
        assert_eq!(eight.group_of_layer(77).unwrap(), 7);
        assert!(eight.group_of_layer(78).is_err());
        let one = LayerGroups::new(&g, 1).unwrap();
        assert_eq!((one.len(), one.arenas(0)), (1, 0..99));
        // More groups than layers: one per layer.
        assert_eq!(LayerGroups::new(&g, 500).unwrap().len(), 78);
        assert!(LayerGroups::new(&g, 0).is_err());
        let l = Geometry::preset("llama3-8b", 4).unwrap();
        let lg = LayerGroups::new(&l, 32).unwrap();
        assert_eq!((lg.arenas(0), lg.arenas(31)), (0..2, 62..64));
        assert!(lg.check(63).is_err(), "groups of another geometry");
        assert!(lg.check_waits(&[WaitFor::Nothing; 2]).is_err());
        lg.check_waits(&[WaitFor::Nothing]).unwrap();
        lg.check_waits(&[WaitFor::Nothing; 32]).unwrap();
        // Sparse ids count as positions.
        let s = Geometry::new(
            "m",
            16,
            vec![
                crate::ArenaSpec::packed("a", 64, 4),
                crate::ArenaSpec::packed("b", 64, 4),
                crate::ArenaSpec::packed("c", 64, 4),
            ],
        )
        .unwrap()
        .with_layers(vec![4, 4, 9])
        .unwrap();
        let sg = LayerGroups::new(&s, 2).unwrap();
        assert_eq!((sg.arenas(0), sg.arenas(1), sg.layer_count()), (0..2, 2..3, 2));
    }
}

//! Layer-wise saves and restores of a [`Rank`] ([`Rank::restore_layers`], [`Rank::save_layers`]):
//! the same planning, pins, reservations and completion protocol as [`Rank::restore`] and
//! [`Rank::save_with`], with the copy submitted group by group ([`crate::copy::layers`]) and the
//! handle carrying each layer group's readiness ([`CopyHandle::wait_layer`]).

use super::{Rank, SaveTicket};
use crate::copy::layers::LayerGroups;
use crate::copy::WaitFor;
use crate::error::TierError;
use crate::key::ContentKey;
use crate::tier::config::SaveOptions;
use crate::tier::handle::CopyHandle;
use crate::tier::lease::Lease;

/// How a rank submits a copy ([`Rank::launch`]): whole-block after one wait, or layer-wise
/// ([`crate::copy::layers::copy_layers`]), group by group after one wait or one per group.
pub(crate) enum Launch<'a> {
    /// One whole-block copy after the wait.
    Whole(WaitFor),
    /// Group by group, after one wait or one per group.
    Layers(LayerGroups, &'a [WaitFor]),
}

impl Rank {
    /// The layer groups of this rank's layers ([`LayerGroups::new`]): those of the tier's geometry,
    /// or, where it names none (a connected tier's geometry comes from the daemon, which sends no
    /// layer ids; a geometry rebuilt from an engine's tensors), those of the rank's backend.
    ///
    /// # Errors
    /// [`TierError::Copy`] with [`CopyError::BadArgument`](crate::error::CopyError::BadArgument) for `groups == 0`.
    pub fn layer_groups(&self, groups: u32) -> Result<LayerGroups, TierError> {
        let (tier, backend) = (self.core.geometry(), self.backend.geometry());
        let g = if tier.layer_count() == 1 && backend.layer_count() > 1 { backend } else { tier };
        Ok(LayerGroups::new(g, groups)?)
    }

    /// [`Rank::restore`] in layer order: the batch moves one group of layers at a time (`groups`
    /// groups of consecutive layers of the tier's geometry, [`LayerGroups::new`]), every block's
    /// group 0 first, as one submission after `wait`. The handle's [`CopyHandle::wait_layer`]
    /// (`layer_event`) orders the engine's stream after one layer's pages only, so the suffix's
    /// layer 0 can run while later layers are still crossing PCIe. The handle completes, as for
    /// [`Rank::restore`], when every group is in place and the pins are dropped.
    ///
    /// A connected tier's rank copies layer-wise too (it runs its copies itself; the daemon only
    /// pins). A backend without layer-wise submission restores the whole batch at once; the
    /// handle's layer waits then wait for the whole copy.
    ///
    /// # Errors
    /// As [`Rank::restore`]; [`TierError::Copy`] with [`CopyError::BadArgument`](crate::error::CopyError::BadArgument) for `groups == 0`.
    pub fn restore_layers(
        &self,
        lease: &Lease,
        gpu_pages: &[u64],
        wait: WaitFor,
        groups: u32,
    ) -> Result<CopyHandle, TierError> {
        let groups = self.layer_groups(groups)?;
        self.restore_how(lease, gpu_pages, Launch::Layers(groups, &[wait]))
    }

    /// [`Rank::save_with`] in layer order, for a save during the prefill: the copy of layer group
    /// `g` (`groups` groups, [`LayerGroups::new`]) reads the GPU pages only after `waits[g]`,
    /// typically the engine's `CUevent` recorded after the group's last layer wrote its pages
    /// (`WaitFor::CudaEvent`, recorded before this call). `waits` holds one entry (before the
    /// whole save) or one per group. The copy runs on the backend's save stream, never on the
    /// engine's, so the save of early layers runs under the prefill of later ones. The ticket's
    /// handle completes when every group is saved and the blocks are committed; its layer waits
    /// say when a group's pages have been read (the engine may then rewrite them).
    ///
    /// A connected tier's rank saves layer-wise too (the daemon reserves, the rank copies). A
    /// backend without layer-wise submission saves the whole batch after `waits`' last entry.
    ///
    /// # Errors
    /// As [`Rank::save_with`]; [`TierError::Copy`] with [`CopyError::BadArgument`](crate::error::CopyError::BadArgument)
    /// for `groups == 0` or [`CopyError::WaitCount`](crate::error::CopyError::WaitCount) for a wait
    /// count other than 1 or the group count (nothing reserved).
    pub fn save_layers(
        &self,
        keys: &[ContentKey],
        gpu_pages: &[u64],
        waits: &[WaitFor],
        groups: u32,
        opts: SaveOptions,
    ) -> Result<SaveTicket, TierError> {
        let groups = self.layer_groups(groups)?;
        groups.check_waits(waits)?;
        self.save_how(keys, gpu_pages, Launch::Layers(groups, waits), opts)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::copy::host::MemcpyArenas;
    use crate::copy::{EngineArenas, WaitFor};
    use crate::error::{CopyError, TierError};
    use crate::geometry::{ArenaSpec, Geometry};
    use crate::slab::pool::{BackingChoice, PoolConfig};
    use crate::tier::{HostTier, SaveOptions, TierConfig};
    use crate::ContentKey;
    use std::sync::Arc;

    fn setup() -> (Geometry, Arc<MemcpyArenas>, HostTier) {
        let arenas = (0..6).map(|i| ArenaSpec::packed(format!("a{i}"), 48, 16)).collect();
        let g = Geometry::new("layers", 4, arenas).unwrap().with_layers(vec![0, 0, 1, 2, 2, 2]).unwrap();
        let host = Arc::new(MemcpyArenas::new(&g).unwrap());
        let mut cfg = TierConfig::new(g.clone(), 8 * g.slot_bytes());
        cfg.pool = PoolConfig { bytes: 8 * g.slot_bytes(), backing: BackingChoice::Plain, ..Default::default() };
        (g, host, HostTier::new(cfg).unwrap())
    }

    /// Through the tier: a layer-wise save with one wait per group, then a layer-wise restore
    /// whose layer waits give each layer's bytes, and whose completion gives all of them.
    #[test]
    fn layer_wise_save_and_restore_through_a_rank() {
        let (_, host, tier) = setup();
        let rank = tier.attach(host.backend().unwrap()).unwrap();
        let ns = tier.namespace();
        let keys: Vec<ContentKey> = (0..4u8).map(|i| ns.key_from_bytes(&[i])).collect();
        host.fill(&[0, 1, 2, 3], &keys).unwrap();
        let groups = rank.layer_groups(3).unwrap();
        assert_eq!((groups.len(), groups.arenas(1)), (3, 2..3));
        let e = rank.save_layers(&keys, &[0, 1, 2, 3], &[WaitFor::Nothing; 2], 3, SaveOptions::default());
        assert!(matches!(e, Err(TierError::Copy(CopyError::WaitCount { waits: 2, groups: 3 }))), "{e:?}");
        let t = rank.save_layers(&keys, &[0, 1, 2, 3], &[WaitFor::Nothing; 3], 3, SaveOptions::default()).unwrap();
        assert_eq!(t.handle.layer_groups().map(|l| l.len()), Some(3));
        t.handle.wait().unwrap();
        let lease = tier.query(&keys);
        assert_eq!(lease.len(), 4);
        let h = rank.restore_layers(&lease, &[9, 10, 11, 12], WaitFor::Nothing, 2).unwrap();
        assert_eq!(h.layer_groups().map(|l| (l.len(), l.layer_count())), Some((2, 3)));
        assert_eq!(h.layer_event(0).unwrap(), None, "the host backend has no device events");
        let bad = h.wait_layer(3, 0).unwrap_err();
        assert!(matches!(bad, TierError::Copy(CopyError::NoSuchLayer { layer: 3, layers: 3 })), "{bad:?}");
        assert!(bad.to_string().contains("layer 3 does not exist"), "{bad}");
        for layer in 0..3 {
            h.wait_layer(layer, 0).unwrap();
            assert!(h.is_layer_ready(layer).unwrap());
        }
        h.wait().unwrap();
        host.verify(&[9, 10, 11, 12], &keys).unwrap();
        assert!(rank.restore_layers(&tier.query(&keys), &[1], WaitFor::Nothing, 0).is_err());
        // A whole-block handle answers layer queries with the whole copy.
        let lease = tier.query(&keys);
        let whole = rank.restore(&lease, &[13, 14], WaitFor::Nothing).unwrap();
        whole.wait_layer(40, 0).unwrap();
        assert!(whole.layer_groups().is_none() && whole.is_layer_ready(0).unwrap());
        host.verify(&[13, 14], &keys[..2]).unwrap();
    }
}

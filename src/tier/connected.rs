//! The connected tier (feature `remote`): a [`HostTier`] whose state machine runs in the tier
//! daemon. Its calls go over the connection of [`crate::remote::client`], which speaks in wire
//! terms; this module turns the daemon's answers into the tier's own values (leases, save
//! tickets, completion handles) and runs the copies on this process's ranks.
//!
//! A connected tier is the [`Flavor::Connected`] flavour of [`HostTier`]: it holds a
//! [`ConnectedTier`] (the connection, the daemon's geometry and policy, this process's mapping of
//! the shared pool), never a [`crate::tier::core::Core`]. Its ranks hold the same, to copy; its
//! leases hold the daemon's lease and the blocks as the daemon leased them.

use super::rank::layers::Launch;
use super::rank::{CopyOutcome, Settle};
use super::stats::{AuditReport, TierStats};
use super::{Fit, Flavor, HostTier, Rank, SaveOptions, SaveTicket};
use crate::copy::{CopyPair, Direction};
use crate::error::{Error, TierError};
use crate::evict::PolicyKind;
use crate::geometry::Geometry;
use crate::index::SlotRef;
use crate::key::ContentKey;
use crate::remote::client::{self, Conn, ConnectOptions, LeaseToken, RemoteLease};
use crate::remote::proto::{Outcome, Request, WireAudit, WireBlock, WireClient, WireSsdStats, WireStats};
use crate::remote::ClientStats;
use crate::slab::pool::HostPool;
use crate::slab::slot::SlotId;
use crate::tier::handle::CopyHandle;
use crate::tier::lease::{Lease, LeaseOf, LeasedBlock};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What a connected tier holds in this process (shared by the tier handle, its clones and its
/// ranks): the daemon owns the index, the slots, the leases and eviction.
pub(crate) struct ConnectedTier {
    /// The connection to the daemon.
    pub(super) conn: Arc<Conn>,
    /// The daemon's block layout (with the daemon's page count: each rank's backend has its own).
    pub(super) geometry: Geometry,
    /// This process's mapping of the daemon's pool: ranks copy to and from its slots; its free
    /// list is not the daemon's.
    pub(super) pool: HostPool,
    /// The daemon's eviction policy.
    pub(super) policy: PolicyKind,
    /// Set by [`HostTier::shutdown`] on this handle or a clone (the daemon goes on serving).
    shutting_down: AtomicBool,
}

impl ConnectedTier {
    pub(super) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }

    pub(super) fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Release);
    }

    /// [`HostTier::try_query_shared`]: the daemon's lease on the longest ready prefix of `keys`.
    pub(super) fn query(&self, keys: &[ContentKey], uses: u32) -> Result<Lease, TierError> {
        let (remote, blocks, sources) = self.conn.query(keys, uses, self.pool.capacity())?;
        Ok(Lease::connected(leased(blocks), remote, sources))
    }

    /// The lease [`HostTier::query_shared`] answers when the daemon is gone: settled from birth,
    /// nothing leased (a miss).
    pub(super) fn settled_lease(&self) -> Lease {
        Lease::connected(Vec::new(), RemoteLease::settled(self.conn.clone()), Vec::new())
    }

    /// [`HostTier::try_stats`]: the daemon's statistics of its tier.
    pub(super) fn stats(&self) -> Result<TierStats, TierError> {
        self.conn.stats().map(TierStats::from)
    }

    /// [`HostTier::try_ssd_stats`]: the daemon's SSD tier's figures (`None` without one).
    pub(super) fn ssd_stats(&self) -> Result<Option<crate::SsdStats>, TierError> {
        self.conn.ssd_stats().map(|s| s.map(crate::SsdStats::from))
    }
}

impl std::fmt::Debug for ConnectedTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectedTier")
            .field("model", &self.geometry.model())
            .field("capacity", &self.pool.capacity())
            .field("policy", &self.policy.name())
            .finish()
    }
}

impl Lease {
    /// This lease as a token another process connected to the same daemon opens with
    /// [`HostTier::open_lease`], so several engine processes (data-parallel ranks) restore from one
    /// lease, each with one of its uses (see [`HostTier::query_shared`]). Every handle, in any
    /// process, keeps the lease alive; it settles as a lease does in one process (consumed,
    /// released, or when the last handle is dropped; a process that exits drops its handles).
    ///
    /// `None` for a lease of an in-process tier, and for a lease settled from birth (nothing
    /// leased): there is nothing to share.
    #[cfg_attr(docsrs, doc(cfg(feature = "remote")))]
    pub fn token(&self) -> Option<LeaseToken> {
        match self.of() {
            LeaseOf::InProcess(_) => None,
            LeaseOf::Connected { remote, .. } => remote.token(),
        }
    }
}

/// The daemon's leased blocks as the tier's (already checked by the connection).
fn leased(wire: Vec<WireBlock>) -> Vec<LeasedBlock> {
    wire.into_iter()
        .map(|b| LeasedBlock { key: b.key, slot: SlotRef { slot: SlotId(b.slot), generation: b.generation } })
        .collect()
}

impl From<CopyOutcome> for Outcome {
    fn from(o: CopyOutcome) -> Self {
        match o {
            CopyOutcome::Done => Outcome::Done,
            CopyOutcome::Failed => Outcome::Failed,
            CopyOutcome::Unknown => Outcome::Unknown,
            CopyOutcome::SubmitPanicked if crate::seeded::seeded("submit-panic-spends-use") => Outcome::Unknown,
            CopyOutcome::SubmitPanicked => Outcome::SubmitPanicked,
        }
    }
}

impl Rank {
    /// A connected rank's save ([`Rank::save_with`], [`Rank::save_layers`]; lengths and pages
    /// already checked): the daemon plans and reserves, this process copies whole-block or
    /// layer-wise as `how` says, then tells the daemon how the copy ended.
    pub(super) fn save_connected(
        &self,
        tier: &ConnectedTier,
        keys: &[ContentKey],
        gpu_pages: &[u64],
        how: Launch<'_>,
        opts: SaveOptions,
    ) -> Result<SaveTicket, TierError> {
        let conn = &tier.conn;
        let p =
            conn.prepare_save(keys, opts.fit == Fit::Prefix, opts.prefix_depth, opts.parent, tier.pool.capacity())?;
        let client::PreparedSave { save, saving, slots, resident, in_flight, duplicates, dropped } = p;
        if saving.is_empty() {
            return Ok(SaveTicket { saving, resident, in_flight, duplicates, dropped, handle: CopyHandle::ready() });
        }
        let batch: Vec<CopyPair> = saving.iter().zip(&slots).map(|(&i, &s)| CopyPair::new(gpu_pages[i], s)).collect();
        let c = conn.clone();
        let settle: Settle = Box::new(move |outcome, latency| {
            c.expect_done(&Request::FinishSave { save, outcome: outcome.into(), latency_ns: wire_ns(latency) })
        });
        // SAFETY: the daemon reserved every slot of `batch` (WRITING) for this save and reuses none of
        // them before the FinishSave that `settle` sends after the copy has finished, or before this
        // process is gone; the pool is mapped as long as this rank's connected tier lives, which the
        // rank holds. The GPU pages are the caller's, who may not rewrite them before the handle completes.
        match unsafe { self.launch(Direction::Save, &batch, how, settle) } {
            Ok(handle) => Ok(SaveTicket { saving, resident, in_flight, duplicates, dropped, handle }),
            Err(e) => {
                let _ = conn.call(&Request::FinishSave { save, outcome: Outcome::NotSubmitted, latency_ns: None });
                Err(e)
            }
        }
    }

    /// A connected rank's restore ([`Rank::restore`], [`Rank::restore_layers`]; lease and rank
    /// checked to share the tier): the daemon takes the restore's pins and a use, this process
    /// copies whole-block or layer-wise as `how` says, then tells the daemon.
    pub(super) fn restore_connected(
        &self,
        lease: &RemoteLease,
        gpu_pages: &[u64],
        how: Launch<'_>,
    ) -> Result<CopyHandle, TierError> {
        let conn = lease.conn();
        if gpu_pages.is_empty() {
            if lease.id() != 0 {
                conn.expect_done(&Request::ConsumeUse { lease: lease.id() })?;
            }
            return Ok(CopyHandle::ready());
        }
        let (restore, slots) =
            match conn.call(&Request::Restore { lease: lease.id(), blocks: gpu_pages.len() as u32 })? {
                crate::remote::proto::Reply::Restoring { restore, slots } => (restore, slots),
                r => return Err(client::unexpected(&r)),
            };
        if slots.len() != gpu_pages.len() || slots.iter().any(|&s| s >= self.tier.pool().capacity()) {
            let _ = conn.call(&Request::FinishRestore { restore, outcome: Outcome::NotSubmitted, latency_ns: None });
            return Err(client::lost("the daemon pinned slots this restore did not ask for"));
        }
        let batch: Vec<CopyPair> = gpu_pages.iter().zip(&slots).map(|(&p, &s)| CopyPair::new(p, s)).collect();
        let c = conn.clone();
        let settle: Settle = Box::new(move |outcome, latency| {
            // The copy's bytes are in place whatever the daemon says: the handle reports the copy.
            let _ = c.call(&Request::FinishRestore { restore, outcome: outcome.into(), latency_ns: wire_ns(latency) });
            Ok(())
        });
        // SAFETY: the daemon pinned every slot of `batch` (READY) for this restore and keeps the pins
        // until the FinishRestore that `settle` sends after the copy has finished, or until this process
        // is gone; the pool stays mapped while the rank lives (it holds its connected tier). The caller
        // owns the GPU pages until the handle completes.
        match unsafe { self.launch(Direction::Restore, &batch, how, settle) } {
            Ok(handle) => {
                let _ = conn.call(&Request::RestoreSubmitted { restore });
                Ok(handle)
            }
            Err(e) => {
                let _ =
                    conn.call(&Request::FinishRestore { restore, outcome: Outcome::NotSubmitted, latency_ns: None });
                Err(e)
            }
        }
    }
}

/// A copy's queue-to-completion time as `FinishSave` / `FinishRestore` carry it (nanoseconds).
fn wire_ns(latency: Option<std::time::Duration>) -> Option<u64> {
    latency.map(|l| l.as_nanos().min(u64::MAX as u128) as u64)
}

/// The daemon's audit of its tier over `keys` (the inner `Err` names the first violated invariant).
pub(crate) fn audit(conn: &Conn, keys: &[ContentKey]) -> Result<Result<AuditReport, String>, TierError> {
    Ok(conn.audit(keys)?.map(|a: WireAudit| AuditReport {
        free: a.free as usize,
        writing: a.writing as usize,
        ready: a.ready as usize,
        evicting: a.evicting as usize,
        pinned: a.pinned as usize,
    }))
}

fn connect_impl(path: &Path, opts: &ConnectOptions) -> Result<HostTier, Error> {
    let client::Connected { conn, geometry, pool, policy } = client::connect(path, opts)?;
    let tier = ConnectedTier { conn: Arc::new(conn), geometry, pool, policy, shutting_down: AtomicBool::new(false) };
    Ok(HostTier { flavor: Flavor::Connected(Arc::new(tier)) })
}

impl HostTier {
    /// Connects to the tier daemon (`kvtierd`) listening on the Unix socket `path` and returns a
    /// tier with the same API as [`HostTier::new`]'s: the daemon owns the index, the slots, the
    /// leases and eviction over a pool in shared memory, which this process maps; ranks attached
    /// here copy between their own GPU arenas and that mapping in this process. Every engine
    /// process connects on its own; they share the daemon's blocks. The tier's geometry is the
    /// daemon's (with the daemon's page count: give each rank's backend its own).
    ///
    /// Before the hello is sent, the daemon's uid (`SO_PEERCRED` of the socket) must be this
    /// process's effective uid or root ([`HostTier::connect_with`] configures another). The pool's
    /// memfd must be size-sealed and as long as the welcome says before it is mapped.
    ///
    /// Connect after forking: a connection serves the process that made it. Its sockets are
    /// close-on-exec, and every call from another process (a child forked after the connection
    /// was made) fails with [`TierError::ForkedChild`] before anything is sent.
    ///
    /// # Errors
    /// [`Error::Tier`] with [`TierError::Disconnected`] (no daemon at `path`, or it hung up),
    /// [`TierError::UntrustedDaemon`] (the socket's peer runs as another uid),
    /// [`TierError::ProtocolMismatch`]; [`Error::Pool`] if the pool cannot be mapped
    /// ([`crate::PoolError::UnsealedSharedPool`], [`crate::PoolError::SharedPoolTooShort`],
    /// [`crate::PoolError::Map`]).
    #[cfg_attr(docsrs, doc(cfg(feature = "remote")))]
    pub fn connect(path: impl AsRef<Path>) -> Result<HostTier, Error> {
        connect_impl(path.as_ref(), &ConnectOptions::new())
    }

    /// [`HostTier::connect`], checking that the daemon serves `geometry`'s namespace (model, page
    /// size, arenas and shard).
    ///
    /// # Errors
    /// As [`HostTier::connect`]; [`TierError::GeometryMismatch`] if the daemon's namespace differs.
    #[cfg_attr(docsrs, doc(cfg(feature = "remote")))]
    pub fn connect_as(path: impl AsRef<Path>, geometry: &Geometry) -> Result<HostTier, Error> {
        connect_impl(path.as_ref(), &ConnectOptions::new().geometry(geometry))
    }

    /// [`HostTier::connect`] with options: the namespace to check ([`ConnectOptions::geometry`])
    /// and the uid the daemon must run as ([`ConnectOptions::expected_uid`]).
    ///
    /// # Errors
    /// As [`HostTier::connect_as`].
    #[cfg_attr(docsrs, doc(cfg(feature = "remote")))]
    pub fn connect_with(path: impl AsRef<Path>, options: &ConnectOptions) -> Result<HostTier, Error> {
        connect_impl(path.as_ref(), options)
    }

    /// The tier daemon's client processes as it counts them, this connection's own session left
    /// out: one row per process (its sessions summed), busiest first (bytes saved and restored,
    /// then queries). An in-process tier has no clients: empty.
    ///
    /// # Errors
    /// [`TierError::Disconnected`] (connected tiers only).
    #[cfg_attr(docsrs, doc(cfg(feature = "remote")))]
    pub fn clients(&self) -> Result<Vec<ClientStats>, TierError> {
        match &self.flavor {
            Flavor::InProcess(_) => Ok(Vec::new()),
            Flavor::Connected(d) => Ok(d.conn.clients()?.into_iter().map(ClientStats::from).collect()),
        }
    }

    /// True for a tier reached through the tier daemon ([`HostTier::connect`]).
    #[cfg_attr(docsrs, doc(cfg(feature = "remote")))]
    pub fn is_connected_tier(&self) -> bool {
        matches!(&self.flavor, Flavor::Connected(_))
    }

    /// The daemon connection of a connected tier (`None` in process).
    pub(crate) fn remote(&self) -> Option<&Arc<Conn>> {
        match &self.flavor {
            Flavor::InProcess(_) => None,
            Flavor::Connected(d) => Some(&d.conn),
        }
    }

    /// Opens a lease another process shared ([`Lease::token`]), taking a handle on it: the lease
    /// lives while any handle does. The blocks are the lease's, in key order.
    ///
    /// # Errors
    /// [`TierError::ForeignLease`] for an in-process tier or a token of another daemon run (the
    /// daemon restarted since); [`TierError::LeaseSettled`] if every handle on it is gone;
    /// [`TierError::Disconnected`].
    #[cfg_attr(docsrs, doc(cfg(feature = "remote")))]
    pub fn open_lease(&self, token: &LeaseToken) -> Result<Lease, TierError> {
        let Flavor::Connected(d) = &self.flavor else { return Err(TierError::ForeignLease) };
        let (remote, blocks, sources) = d.conn.open_lease(token, d.pool.capacity())?;
        Ok(Lease::connected(leased(blocks), remote, sources))
    }
}

impl From<ClientStats> for WireClient {
    fn from(c: ClientStats) -> Self {
        // Exhaustive on purpose: a field added to ClientStats must be added here (and the
        // protocol version bumped).
        let ClientStats {
            pid,
            sessions,
            connected_ms,
            lease_handles,
            leased_blocks,
            hints,
            copies_in_flight,
            queries,
            hit_blocks,
            miss_blocks,
            saved_blocks,
            bytes_saved,
            restored_blocks,
            bytes_restored,
            hints_given,
            refused,
        } = c;
        WireClient {
            pid,
            sessions,
            connected_ms,
            lease_handles,
            leased_blocks,
            hints,
            copies_in_flight,
            queries,
            hit_blocks,
            miss_blocks,
            saved_blocks,
            bytes_saved,
            restored_blocks,
            bytes_restored,
            hints_given,
            refused,
        }
    }
}

impl From<WireClient> for ClientStats {
    fn from(w: WireClient) -> Self {
        // Exhaustive on purpose, as above.
        let WireClient {
            pid,
            sessions,
            connected_ms,
            lease_handles,
            leased_blocks,
            hints,
            copies_in_flight,
            queries,
            hit_blocks,
            miss_blocks,
            saved_blocks,
            bytes_saved,
            restored_blocks,
            bytes_restored,
            hints_given,
            refused,
        } = w;
        ClientStats {
            pid,
            sessions,
            connected_ms,
            lease_handles,
            leased_blocks,
            hints,
            copies_in_flight,
            queries,
            hit_blocks,
            miss_blocks,
            saved_blocks,
            bytes_saved,
            restored_blocks,
            bytes_restored,
            hints_given,
            refused,
        }
    }
}

impl From<TierStats> for WireStats {
    fn from(s: TierStats) -> Self {
        // Exhaustive on purpose: a field added to TierStats must be added here (and the protocol
        // version bumped).
        let TierStats {
            queries,
            hit_blocks,
            miss_blocks,
            saved_blocks,
            save_skipped_resident,
            save_skipped_in_flight,
            save_skipped_duplicate,
            save_dropped,
            saves_refused,
            save_failed_blocks,
            restored_blocks,
            restore_failed_blocks,
            evictions,
            explicit_evictions,
            bytes_saved,
            bytes_restored,
            expired_leases,
            live_leases,
            oldest_lease_age_ms,
            quarantined_slots,
            pinned_slots,
            ready_slots,
            writing_slots,
            evicting_slots,
            free_slots,
            capacity,
            index_entries,
            quarantined_pins,
        } = s;
        WireStats {
            queries,
            hit_blocks,
            miss_blocks,
            saved_blocks,
            save_skipped_resident,
            save_skipped_in_flight,
            save_skipped_duplicate,
            save_dropped,
            saves_refused,
            save_failed_blocks,
            restored_blocks,
            restore_failed_blocks,
            evictions,
            explicit_evictions,
            bytes_saved,
            bytes_restored,
            expired_leases,
            live_leases,
            oldest_lease_age_ms,
            quarantined_slots,
            pinned_slots,
            ready_slots,
            writing_slots,
            evicting_slots,
            free_slots,
            capacity,
            index_entries,
            quarantined_pins,
        }
    }
}

impl From<WireStats> for TierStats {
    fn from(w: WireStats) -> Self {
        TierStats {
            queries: w.queries,
            hit_blocks: w.hit_blocks,
            miss_blocks: w.miss_blocks,
            saved_blocks: w.saved_blocks,
            save_skipped_resident: w.save_skipped_resident,
            save_skipped_in_flight: w.save_skipped_in_flight,
            save_skipped_duplicate: w.save_skipped_duplicate,
            save_dropped: w.save_dropped,
            saves_refused: w.saves_refused,
            save_failed_blocks: w.save_failed_blocks,
            restored_blocks: w.restored_blocks,
            restore_failed_blocks: w.restore_failed_blocks,
            evictions: w.evictions,
            explicit_evictions: w.explicit_evictions,
            bytes_saved: w.bytes_saved,
            bytes_restored: w.bytes_restored,
            expired_leases: w.expired_leases,
            live_leases: w.live_leases,
            oldest_lease_age_ms: w.oldest_lease_age_ms,
            quarantined_slots: w.quarantined_slots,
            pinned_slots: w.pinned_slots,
            ready_slots: w.ready_slots,
            writing_slots: w.writing_slots,
            evicting_slots: w.evicting_slots,
            free_slots: w.free_slots,
            capacity: w.capacity,
            index_entries: w.index_entries,
            quarantined_pins: w.quarantined_pins,
        }
    }
}

impl From<crate::SsdStats> for WireSsdStats {
    fn from(s: crate::SsdStats) -> Self {
        WireSsdStats {
            capacity: s.capacity,
            blocks: s.blocks,
            recovered_blocks: s.recovered_blocks,
            recovered_torn: s.recovered_torn,
            recovered_foreign: s.recovered_foreign,
            demoted_blocks: s.demoted_blocks,
            bytes_demoted: s.bytes_demoted,
            demotions_skipped: s.demotions_skipped,
            demotions_dropped: s.demotions_dropped,
            demotion_failures: s.demotion_failures,
            demotions_pending: s.demotions_pending,
            promoted_blocks: s.promoted_blocks,
            bytes_promoted: s.bytes_promoted,
            promotion_failures: s.promotion_failures,
            disk_evictions: s.disk_evictions,
            io_direct: s.io_direct,
            io_buffered: s.io_buffered,
        }
    }
}

impl From<WireSsdStats> for crate::SsdStats {
    fn from(w: WireSsdStats) -> Self {
        crate::SsdStats {
            capacity: w.capacity,
            blocks: w.blocks,
            recovered_blocks: w.recovered_blocks,
            recovered_torn: w.recovered_torn,
            recovered_foreign: w.recovered_foreign,
            demoted_blocks: w.demoted_blocks,
            bytes_demoted: w.bytes_demoted,
            demotions_skipped: w.demotions_skipped,
            demotions_dropped: w.demotions_dropped,
            demotion_failures: w.demotion_failures,
            demotions_pending: w.demotions_pending,
            promoted_blocks: w.promoted_blocks,
            bytes_promoted: w.bytes_promoted,
            promotion_failures: w.promotion_failures,
            disk_evictions: w.disk_evictions,
            io_direct: w.io_direct,
            io_buffered: w.io_buffered,
        }
    }
}

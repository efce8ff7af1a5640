//! The calls that hand out slots and leases ([`Conn::prepare_save`], [`Conn::query`],
//! [`Conn::open_lease`]), their answers checked against what was asked, and the daemon's leases as
//! handles ([`RemoteLease`], [`LeaseToken`]).

use super::connection::{lost, unexpected, Conn};
use crate::error::TierError;
use crate::key::ContentKey;
use crate::remote::proto::{Outcome, Reply, Request, WireBlock};
use std::sync::Arc;

/// A save the daemon prepared ([`Conn::prepare_save`]): slots reserved for the keys at `saving`.
#[derive(Debug)]
pub(crate) struct PreparedSave {
    /// The daemon's id of the save (0 if nothing is saved).
    pub(crate) save: u64,
    /// Indices into the keys of those saved, one per slot of `slots`.
    pub(crate) saving: Vec<usize>,
    /// The slots reserved (WRITING) for them.
    pub(crate) slots: Vec<u32>,
    /// Keys already resident.
    pub(crate) resident: usize,
    /// Keys being saved by another save.
    pub(crate) in_flight: usize,
    /// Keys repeated in this save.
    pub(crate) duplicates: usize,
    /// Keys dropped (did not fit or were not admitted).
    pub(crate) dropped: usize,
}

impl Conn {
    /// Asks the daemon to plan a save of `keys` (the daemon's fit, eviction and reservations).
    /// Whatever it prepared that this call did not ask for is given back and refused.
    ///
    /// # Errors
    /// The daemon's [`TierError`]; [`TierError::Disconnected`], also for a plan naming keys or
    /// slots out of range (`capacity`: the pool's slots).
    pub(crate) fn prepare_save(
        &self,
        keys: &[ContentKey],
        prefix: bool,
        prefix_depth: Option<u32>,
        parent: Option<ContentKey>,
        capacity: u32,
    ) -> Result<PreparedSave, TierError> {
        let req = Request::PrepareSave { keys: keys.to_vec(), prefix, prefix_depth, parent };
        let p = match self.call(&req)? {
            Reply::SavePrepared { save, saving, slots, resident, in_flight, duplicates, dropped } => PreparedSave {
                save,
                saving: saving.into_iter().map(|i| i as usize).collect(),
                slots,
                resident: resident as usize,
                in_flight: in_flight as usize,
                duplicates: duplicates as usize,
                dropped: dropped as usize,
            },
            r => return Err(unexpected(&r)),
        };
        if p.saving.len() != p.slots.len()
            || p.saving.iter().any(|&i| i >= keys.len())
            || p.slots.iter().any(|&s| s >= capacity)
        {
            if p.save != 0 {
                let _ =
                    self.call(&Request::FinishSave { save: p.save, outcome: Outcome::NotSubmitted, latency_ns: None });
            }
            return Err(lost("the daemon prepared a save this rank did not ask for"));
        }
        Ok(p)
    }

    /// Asks for a lease on the longest ready prefix of `keys` with `uses` restores: the daemon's
    /// lease and its blocks, checked to be a prefix of `keys` within `capacity` slots.
    ///
    /// # Errors
    /// The daemon's [`TierError`]; [`TierError::Disconnected`].
    pub(crate) fn query(
        self: &Arc<Self>,
        keys: &[ContentKey],
        uses: u32,
        capacity: u32,
    ) -> Result<(RemoteLease, Vec<WireBlock>, Vec<crate::source::BlockSource>), TierError> {
        match self.call(&Request::Query { keys: keys.to_vec(), uses })? {
            Reply::Leased { lease, blocks, sources } => {
                check_blocks(Some(keys), &blocks, &sources, capacity)?;
                Ok((RemoteLease { conn: self.clone(), id: lease }, blocks, sources))
            }
            r => Err(unexpected(&r)),
        }
    }

    /// Opens the lease `token` names, taking a handle on it.
    ///
    /// # Errors
    /// [`TierError::ForeignLease`] for a token of another daemon run; the daemon's
    /// [`TierError`]; [`TierError::Disconnected`].
    pub(crate) fn open_lease(
        self: &Arc<Self>,
        token: &LeaseToken,
        capacity: u32,
    ) -> Result<(RemoteLease, Vec<WireBlock>, Vec<crate::source::BlockSource>), TierError> {
        if token.instance != self.instance {
            return Err(TierError::ForeignLease);
        }
        match self.call(&Request::OpenLease { instance: token.instance, lease: token.lease })? {
            Reply::Leased { lease, blocks, sources } => {
                check_blocks(None, &blocks, &sources, capacity)?;
                Ok((RemoteLease { conn: self.clone(), id: lease }, blocks, sources))
            }
            r => Err(unexpected(&r)),
        }
    }
}

/// Refuses leased blocks that are not a prefix of `keys` (when given) or name slots beyond
/// `capacity`, and sources that are neither empty nor one per block.
fn check_blocks(
    keys: Option<&[ContentKey]>,
    wire: &[WireBlock],
    sources: &[crate::source::BlockSource],
    capacity: u32,
) -> Result<(), TierError> {
    let asked = |i: usize, b: &WireBlock| keys.is_none_or(|k| k[i] == b.key);
    if !sources.is_empty() && sources.len() != wire.len() {
        return Err(lost("the daemon named sources for another number of blocks than it leased"));
    }
    if keys.is_some_and(|k| wire.len() > k.len())
        || wire.iter().any(|b| b.slot >= capacity)
        || !wire.iter().enumerate().all(|(i, b)| asked(i, b))
    {
        return Err(lost("the daemon leased blocks this query did not ask for"));
    }
    Ok(())
}

/// A lease held by the tier daemon, as a process sees it (see [`crate::Lease`]).
pub(crate) struct RemoteLease {
    conn: Arc<Conn>,
    /// The daemon's lease id; 0 for a lease settled from birth (nothing leased, or no use).
    id: u64,
}

/// A lease's state as the daemon reports it.
#[derive(Copy, Clone, Debug)]
pub(crate) struct LeaseInfo {
    pub settled: bool,
    pub expired: bool,
    pub uses_left: u32,
}

impl RemoteLease {
    /// A lease settled from birth over `conn` (nothing leased; the daemon holds nothing for it).
    pub(crate) fn settled(conn: Arc<Conn>) -> RemoteLease {
        RemoteLease { conn, id: 0 }
    }

    pub(crate) fn info(&self) -> LeaseInfo {
        let gone = LeaseInfo { settled: true, expired: false, uses_left: 0 };
        if self.id == 0 {
            return gone;
        }
        match self.conn.call(&Request::LeaseInfo { lease: self.id }) {
            Ok(Reply::LeaseInfo { settled, expired, uses_left }) => LeaseInfo { settled, expired, uses_left },
            _ => gone,
        }
    }

    /// The connection the lease was leased over.
    pub(crate) fn conn(&self) -> &Arc<Conn> {
        &self.conn
    }

    /// The daemon's lease id; 0 for a lease settled from birth.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// This lease as a token (`None` for a lease settled from birth: nothing to share).
    pub(crate) fn token(&self) -> Option<LeaseToken> {
        (self.id != 0).then_some(LeaseToken { instance: self.conn.instance, lease: self.id })
    }

    pub(crate) fn release(&self) -> bool {
        if self.id == 0 {
            return false;
        }
        matches!(self.conn.call(&Request::ReleaseLease { lease: self.id }), Ok(Reply::Bool(true)))
    }
}

impl Drop for RemoteLease {
    fn drop(&mut self) {
        if self.id != 0 {
            // One-way; a lost connection has dropped the daemon's handles already.
            let _ = self.conn.call(&Request::DropLease { lease: self.id });
        }
    }
}

/// A lease of a connected tier as bytes another process can open ([`crate::Lease::token`],
/// [`crate::HostTier::open_lease`]): the daemon run and the lease id. 16 bytes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct LeaseToken {
    instance: u64,
    lease: u64,
}

impl LeaseToken {
    /// The token's 16 bytes (daemon run, then lease id, little-endian).
    pub fn to_bytes(self) -> [u8; 16] {
        let mut b = [0; 16];
        b[..8].copy_from_slice(&self.instance.to_le_bytes());
        b[8..].copy_from_slice(&self.lease.to_le_bytes());
        b
    }

    /// A token from its 16 bytes.
    ///
    /// # Errors
    /// [`TierError::ForeignLease`] if `bytes` is not 16 bytes long.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, TierError> {
        let b: [u8; 16] = bytes.try_into().map_err(|_| TierError::ForeignLease)?;
        Ok(LeaseToken {
            instance: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            lease: u64::from_le_bytes(b[8..].try_into().expect("8 bytes")),
        })
    }
}

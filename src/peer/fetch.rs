//! The reader's fetch ([`PeerClient::fetch`]): the shape of a promotion from the SSD tier, with
//! the owner's pool instead of the drive.
//!
//! 1. the local prefix: the keys this instance's host (and SSD tier) holds, pinned as a query does;
//! 2. `Query` the owner for the rest: it pins its longest ready prefix under a lease and answers
//!    (key, offset, generation) per block;
//! 3. reserve local slots `WRITING` under those keys, as a promotion does (a key a local save
//!    reserved first ends the run; so does a pool with no slot to give);
//! 4. one [`super::PeerTransport::read`] for the whole batch;
//! 5. `Validate` with the owner: a block is valid if its owner slot still holds its key at its
//!    generation and the owner's lease had not expired, so the bytes read were that key's;
//! 6. publish the leading run of validated blocks `READY`, pinned for the local lease; abort the
//!    other reservations (index entries first, then the slots go back free);
//! 7. `Release` the owner's lease.
//!
//! Any error after step 3 aborts every reservation, so the local tier is left as it was; only a
//! read that ended while its transfer may still write the slots (past its deadline: a cancel is not
//! synchronous) leaves them quarantined until the transport says the transfer is over
//! ([`super::ReadDone`]), then they go free.

use super::client::{PeerClient, PeerFetch};
use super::transport::BlockRead;
use super::PeerError;
use crate::index::SlotRef;
use crate::key::ContentKey;
use crate::tier::core::{Core, Reserved};
use crate::tier::lease::{Lease, LeasedBlock};
use crate::tier::pins::WriteReservation;
use crate::tier::ssd::reserve_promotion;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Instant;

impl PeerClient {
    /// Leases the longest prefix of `keys` it can: the blocks this instance holds, continued with
    /// blocks fetched from the owner (steps in the module docs); where a fetched run reaches a
    /// block this instance holds, the lease goes on with it, and then with the owner again (one
    /// query, read and validation per run). Every network step must finish by `deadline`. The returned lease has one use ([`Lease::source`] says per block whether it
    /// was local or came from the peer); fetched blocks stay in the local pool (the next query hits
    /// locally).
    ///
    /// # Errors
    /// [`PeerError::OwnerGone`], [`PeerError::Network`], [`PeerError::Deadline`],
    /// [`PeerError::Refused`] (a limit), [`PeerError::Protocol`] (a reply that breaks the
    /// protocol, e.g. keys not asked for), [`PeerError::Transport`]. On every error the local tier
    /// is unchanged: the local prefix's pins are dropped, no slot stays taken, no key `WRITING`.
    /// A failure of a later run (after a block held here) is no error: the lease ends at the
    /// blocks leased before it.
    pub fn fetch(&self, keys: &[ContentKey], deadline: Instant) -> Result<PeerFetch, PeerError> {
        self.fetch_shared(keys, 1, deadline)
    }

    /// [`PeerClient::fetch`] with a lease of `uses` restores (as [`crate::HostTier::query_shared`]:
    /// one per rank that restores it). `uses == 0` gives a settled lease and asks the owner
    /// nothing.
    ///
    /// # Errors
    /// Those of [`PeerClient::fetch`], with the local tier unchanged.
    pub fn fetch_shared(&self, keys: &[ContentKey], uses: u32, deadline: Instant) -> Result<PeerFetch, PeerError> {
        let (f, err) = self.fetch_partial(keys, uses, deadline, usize::MAX, true);
        f.into_result(err)
    }

    /// The fetch of [`PeerClient::fetch_shared`], fetching at most `max_fetch` blocks from the
    /// owner, with a run's error returned beside the lease on what was leased before it (the
    /// local prefix, and the runs fetched before a later run failed; sources kept) instead of in
    /// its place. `record`
    /// counts the lease's acquisition as a query of this tier.
    pub(crate) fn fetch_partial(
        &self,
        keys: &[ContentKey],
        uses: u32,
        deadline: Instant,
        max_fetch: usize,
        record: bool,
    ) -> (PeerFetch, Option<PeerError>) {
        let (mut stale, mut runs, mut left, mut later) = (0, 0, max_fetch, None);
        let mut step = |rest: &[ContentKey], blocks: &mut Vec<LeasedBlock>| -> Result<usize, PeerError> {
            runs += 1;
            match self.fetch_run(&rest[..rest.len().min(left)], blocks, deadline) {
                Ok((n, s)) => {
                    stale += s;
                    left -= n.min(left);
                    Ok(n)
                }
                // A later run (after a block this instance held) that fails ends the lease at the
                // blocks leased so far, fetched and validated ones included; only the first run's
                // failure is the fetch's error.
                Err(e) if runs > 1 => {
                    tracing::debug!("a later peer run ended the lease: {e}");
                    later = Some(e);
                    Ok(0)
                }
                Err(e) => Err(e),
            }
        };
        let (lease, err) = Lease::acquire_with(&self.core, keys, uses, Some(&mut step), record);
        let err = err.or(later);
        self.stale_blocks.fetch_add(stale as u64, Ordering::Relaxed);
        self.fetched_blocks.fetch_add(lease.from_peer() as u64, Ordering::Relaxed);
        (PeerFetch { lease, stale }, err)
    }

    /// Steps 2-7 for `rest`, the keys after the local prefix `blocks`: appends the published
    /// blocks (pinned once each) and returns (published, dropped stale).
    fn fetch_run(
        &self,
        rest: &[ContentKey],
        blocks: &mut Vec<LeasedBlock>,
        deadline: Instant,
    ) -> Result<(usize, usize), PeerError> {
        // The run asked for: no key already leased or repeated, at most a pool's worth and what
        // the owner takes in one query.
        let max = rest.len().min(self.core.pool().capacity() as usize).min(self.limits.keys_per_query as usize);
        let mut seen: HashSet<ContentKey> = blocks.iter().map(|b| b.key).collect();
        let ask: Vec<ContentKey> = rest[..max].iter().take_while(|k| seen.insert(**k)).copied().collect();
        if ask.is_empty() {
            return Ok((0, 0));
        }
        let (lease, owned) = self.query(&ask, deadline)?;
        if owned.len() > ask.len() || owned.iter().zip(&ask).any(|(b, k)| b.key != *k) {
            if lease != 0 {
                let _ = self.release(lease, deadline);
            }
            return Err(PeerError::Protocol("the owner leased keys that were not asked for, or out of order".into()));
        }
        if owned.is_empty() {
            return Ok((0, 0));
        }
        let owned_keys: Vec<ContentKey> = owned.iter().map(|b| b.key).collect();
        let reservation = reserve_promotion(&self.core, &owned_keys);
        let n = reservation.len();
        let landed = Landed::new(&self.core);
        let outcome = (|| {
            if n == 0 {
                return Ok(0);
            }
            let base = self.core.pool().region().host_base;
            // Seeded bug (tests only): `peer-reads-into-one-slot` reads every block into the pool's
            // first slot.
            let one_slot = crate::seeded::seeded("peer-reads-into-one-slot");
            let reads: Vec<BlockRead> = reservation
                .entries()
                .iter()
                .zip(&owned)
                .map(|(r, b)| BlockRead {
                    remote_offset: b.offset,
                    local_offset: if one_slot { 0 } else { (self.core.pool().slot_ptr(r.slot) as usize - base) as u64 },
                    len: self.block_bytes,
                })
                .collect();
            // The slots the transfer may still write after an error are quarantined until the
            // transport says it is over (`landed`).
            self.transport.read_tracked(self.peer, &reads, deadline, landed.done())?;
            let valid = self.validate(lease, n, deadline)?;
            // Seeded bug (tests only): `peer-skips-validate` serves whatever the read brought.
            if crate::seeded::seeded("peer-skips-validate") {
                return Ok(n);
            }
            Ok((0..n).take_while(|&i| valid.get(i).copied().unwrap_or(false)).count())
        })();
        let verified = match outcome {
            Ok(v) => v,
            Err(e) => {
                // Seeded bug (tests only): `peer-abort-leaks-slot` withholds the slots for good.
                if crate::seeded::seeded("peer-abort-leaks-slot") {
                    reservation.quarantine();
                } else if crate::seeded::seeded("peer-deadline-frees-in-flight") || landed.is_over() {
                    // Seeded bug (tests only): `peer-deadline-frees-in-flight` frees slots a
                    // transfer may still write.
                    drop(reservation); // aborted: index entries first, then the slots go free
                } else {
                    landed.quarantine(reservation);
                }
                let _ = self.release(lease, deadline);
                return Err(e);
            }
        };
        let stale = n - verified;
        if stale > 0 {
            let key = owned[verified].key;
            tracing::warn!(key = %key, stale, "a block fetched from a peer failed validation: dropped");
        }
        let committed = reservation.commit_leading_pinned(verified, |_| {});
        // Best effort: an owner that does not hear the release lets the lease expire.
        let _ = self.release(lease, deadline);
        for r in &committed {
            blocks.push(LeasedBlock { key: r.key, slot: SlotRef { slot: r.slot, generation: r.generation } });
        }
        Ok((committed.len(), stale))
    }
}

/// Whether a read's transfer is over, and the slots it may still write until it is: the slots are
/// quarantined (`WRITING`, withheld, their index entries gone) when the read failed before the
/// transport said so, and go back free when it does (the [`super::ReadDone`] it was given drops).
struct Landed {
    core: crate::sync::Arc<Core>,
    state: std::sync::Arc<Mutex<LandedState>>,
}

enum LandedState {
    /// The transfer may still write.
    Running,
    /// The transport said the transfer is over.
    Over,
    /// Over an error the slots were quarantined while the transfer ran: freed when it is over.
    Quarantined(Vec<Reserved>),
}

impl Landed {
    fn new(core: &crate::sync::Arc<Core>) -> Landed {
        Landed { core: core.clone(), state: std::sync::Arc::new(Mutex::new(LandedState::Running)) }
    }

    /// The transport's half: dropped when the transfer is over.
    fn done(&self) -> super::ReadDone {
        let (core, state) = (self.core.clone(), self.state.clone());
        super::ReadDone::new(move || {
            let was = std::mem::replace(&mut *super::lock(&state), LandedState::Over);
            if let LandedState::Quarantined(slots) = was {
                for r in slots {
                    core.release_quarantined(r);
                }
            }
        })
    }

    fn is_over(&self) -> bool {
        matches!(*super::lock(&self.state), LandedState::Over)
    }

    /// Quarantines `reservation`'s slots until the transfer is over (at once freed if it already
    /// is).
    fn quarantine(&self, reservation: WriteReservation) {
        let mut st = super::lock(&self.state);
        if matches!(*st, LandedState::Over) {
            drop(st);
            drop(reservation);
            return;
        }
        *st = LandedState::Quarantined(reservation.quarantine_entries());
    }
}

//! One connection's session ([`Session`]): what it holds (lease handles, saves and restores in
//! flight, hints), each request run against the tier under `catch_unwind`, and the session's end,
//! the same however it ends (see the docs of [`crate::server`]).

use super::clients::ClientCounters;
use super::limits::limit;
use super::peer::{exited, ShowPid};
use super::shared::{Parked, Shared};
use crate::copy::Direction;
use crate::error::{Limit, TierError};
use crate::key::ContentKey;
use crate::remote::proto::{Outcome, Reply, Request, WireAudit, WireBlock, WireError};
use crate::tier::core::Reserved;
use crate::tier::lease::{Lease, RestoreHold};
use crate::tier::pins::{SlotPins, WriteReservation};
use crate::tier::prepare::prepare_save;
use crate::tier::{Fit, SaveOptions};
use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn misuse(reason: impl Into<String>) -> TierError {
    if crate::seeded::seeded("misuse-untyped") {
        return TierError::Disconnected { reason: reason.into() };
    }
    TierError::Protocol { reason: reason.into() }
}

/// A save in flight. Dropped without [`PendingSave::take`] (an unwind anywhere), its slots are
/// withheld for good: the writer may be alive and still copying into them.
pub(super) struct PendingSave {
    reservation: Option<WriteReservation>,
}

impl PendingSave {
    fn take(mut self) -> WriteReservation {
        self.reservation.take().expect("a pending save's reservation is taken once")
    }
}

impl Drop for PendingSave {
    fn drop(&mut self) {
        if let Some(r) = self.reservation.take() {
            if !crate::seeded::seeded("pending-copy-drop-frees") {
                r.quarantine();
            }
        }
    }
}

/// A restore in flight. Dropped without [`PendingRestore::take`] (an unwind anywhere), its pins
/// are kept for good and its use stays spent: the reader may be alive and still copying.
pub(super) struct PendingRestore {
    hold: Option<RestoreHold>,
    pins: Option<SlotPins>,
}

impl PendingRestore {
    fn take(mut self) -> (Option<RestoreHold>, SlotPins) {
        (self.hold.take(), self.pins.take().expect("a pending restore's pins are taken once"))
    }
}

impl Drop for PendingRestore {
    fn drop(&mut self) {
        if crate::seeded::seeded("pending-copy-drop-frees") {
            return;
        }
        if let Some(p) = self.pins.take() {
            p.quarantine();
        }
        if let Some(c) = self.hold.take() {
            // Never panic out of a drop (it may run while unwinding).
            let _ = catch_unwind(AssertUnwindSafe(|| c.submitted()));
        }
    }
}

/// A hint this connection gave.
struct OwnedHint {
    id: u64,
    keys: usize,
    /// When the tier drops it by itself (`None`: not within this process's clock range).
    expires: Option<Instant>,
}

/// One connection's state. Dropping it ends the session (see the module docs): whatever way its
/// thread ends, nothing it holds is freed under a copy that may still run, and nothing it holds
/// outlives it except what such a copy still needs.
pub(super) struct Session {
    shared: Arc<Shared>,
    pid: Option<u32>,
    pidfd: Option<OwnedFd>,
    /// Lease id -> handles this connection holds.
    leases: HashMap<u64, u64>,
    /// Handles over `leases`.
    lease_handles: usize,
    /// Lease id -> its blocks, for the leases this connection holds handles on.
    lease_sizes: HashMap<u64, usize>,
    /// Blocks over this connection's handles (each handle counts its lease's blocks).
    leased_blocks: usize,
    pub(super) saves: HashMap<u64, PendingSave>,
    pub(super) restores: HashMap<u64, PendingRestore>,
    hints: Vec<OwnedHint>,
    next_id: u64,
    parked: Vec<Reserved>,
    parked_pins: Vec<SlotPins>,
    /// The process is known to be gone when the session ends (fuzzing: nothing runs a copy), so
    /// what it withheld is released at once.
    pub(super) gone_at_end: bool,
    /// This session's id among the daemon's clients, and its own counters there.
    client_id: u64,
    counters: Arc<ClientCounters>,
}

impl Session {
    pub(super) fn new(shared: Arc<Shared>, pid: Option<u32>, pidfd: Option<OwnedFd>) -> Session {
        let (client_id, counters) = shared.clients.register(pid);
        Session {
            client_id,
            counters,
            shared,
            pid,
            pidfd,
            leases: HashMap::new(),
            lease_handles: 0,
            lease_sizes: HashMap::new(),
            leased_blocks: 0,
            saves: HashMap::new(),
            restores: HashMap::new(),
            hints: Vec::new(),
            next_id: 0,
            parked: Vec::new(),
            parked_pins: Vec::new(),
            gone_at_end: false,
        }
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Counts a finished copy for the tier (bytes, and latency when done) and, when it is done,
    /// for this session's client.
    fn record_copy(
        &self,
        counters: &crate::tier::stats::Counters,
        dir: Direction,
        blocks: u64,
        bytes: u64,
        outcome: Outcome,
        latency_ns: Option<u64>,
    ) {
        let done = outcome == Outcome::Done;
        tracing::debug!(
            "process {}: {dir:?} copy of {blocks} blocks ({bytes} B) ended {outcome:?}, {} us from submission",
            ShowPid(self.pid),
            latency_ns.map_or_else(|| "?".to_string(), |ns| (ns / 1000).to_string()),
        );
        counters.record_copy(dir, blocks, bytes, done, latency_ns.map(Duration::from_nanos));
        if done {
            let (b, n) = match dir {
                Direction::Save => (&self.counters.saved_blocks, &self.counters.bytes_saved),
                Direction::Restore => (&self.counters.restored_blocks, &self.counters.bytes_restored),
            };
            ClientCounters::add(b, blocks);
            ClientCounters::add(n, bytes);
        }
    }
    fn lease(&self, id: u64) -> Result<Lease, TierError> {
        if !self.leases.contains_key(&id) {
            return Err(TierError::ForeignLease);
        }
        let leases = self.shared.leases.lock().unwrap_or_else(|p| p.into_inner());
        leases.get(&id).map(|e| e.lease.clone()).ok_or(TierError::LeaseSettled)
    }

    /// The lease a `Query` answers: the local prefix, continued from the peers when this daemon
    /// reads from peers ([`super::Server::fetch_from_peers`]).
    fn query_lease(&self, keys: &[ContentKey], uses: u32) -> Lease {
        #[cfg(feature = "peers")]
        if let Some((peers, timeout)) = self.shared.peers.get() {
            // The blocks a fetch brings are being written until published: they take slots of
            // this process's bound for the fetch's length, as a save's reservation does.
            let room = self.shared.slot_room(self.pid).min(keys.len());
            // Seeded bug (tests only): `peer-fetch-uncharged` fetches past the process's bound.
            let room = if crate::seeded::seeded("peer-fetch-uncharged") { keys.len() } else { room };
            if room == 0 || self.shared.take_slots(self.pid, room).is_err() {
                return self.shared.tier.query_shared(keys, uses);
            }
            // Given back however the fetch ends, an unwind included (the session catches panics).
            struct Charge<'a>(&'a Shared, Option<u32>, usize);
            impl Drop for Charge<'_> {
                fn drop(&mut self) {
                    self.0.give_slots(self.1, self.2);
                }
            }
            let charge = Charge(&self.shared, self.pid, room);
            let f = peers.query_bounded(keys, uses, std::time::Instant::now() + *timeout, room);
            drop(charge);
            for (i, e) in &f.errors {
                let addr = peers.addrs().nth(*i).unwrap_or("?");
                // A paused peer is logged when it failed, not at every query after.
                if matches!(e, crate::PeerError::Paused { .. }) {
                    tracing::debug!("process {}: peer {addr} skipped: {e}", ShowPid(self.pid));
                } else {
                    tracing::warn!("process {}: peer {addr} failed a fetch: {e}", ShowPid(self.pid));
                }
            }
            if f.fetched > 0 || f.stale > 0 {
                tracing::debug!(
                    "process {}: {} blocks fetched from peers, {} stale",
                    ShowPid(self.pid),
                    f.fetched,
                    f.stale
                );
            }
            return f.lease;
        }
        self.shared.tier.query_shared(keys, uses)
    }

    fn leased(lease: u64, l: &Lease) -> Reply {
        let blocks = l
            .blocks()
            .iter()
            .map(|b| WireBlock { key: b.key, slot: b.slot.slot.0, generation: b.slot.generation })
            .collect();
        // Seeded bug (tests only): `daemon-drops-block-sources` tells every client its blocks
        // were on the daemon's host pool.
        let sources =
            if crate::seeded::seeded("daemon-drops-block-sources") { Vec::new() } else { l.sources().to_vec() };
        Reply::Leased { lease, blocks, sources }
    }

    fn check_keys(&self, n: usize) -> Result<(), TierError> {
        let max = self.shared.limits.keys_per_request;
        if n > max {
            return Err(limit(Limit::KeysPerRequest, n, max));
        }
        Ok(())
    }

    fn check_lease_handle(&self) -> Result<(), TierError> {
        let max = self.shared.limits.leases_per_connection;
        if self.lease_handles >= max {
            return Err(limit(Limit::LeasesPerConnection, self.lease_handles + 1, max));
        }
        Ok(())
    }

    /// Refuses a handle on `n` more leased blocks over
    /// [`Limits::leased_blocks_per_connection`](super::Limits::leased_blocks_per_connection).
    fn check_leased_blocks(&self, n: usize) -> Result<(), TierError> {
        let max = self.shared.limits.leased_blocks_per_connection;
        let asked = self.leased_blocks.saturating_add(n);
        if asked > max && !crate::seeded::seeded("leased-blocks-unbounded") {
            return Err(limit(Limit::LeasedBlocksPerConnection, asked, max));
        }
        Ok(())
    }

    /// Copies this connection has in flight or withheld.
    fn copies(&self) -> usize {
        self.saves.len() + self.restores.len() + self.parked.len() + self.parked_pins.len()
    }

    fn check_copy(&self) -> Result<(), TierError> {
        let max = self.shared.limits.copies_per_connection;
        if self.copies() >= max {
            return Err(limit(Limit::CopiesPerConnection, self.copies() + 1, max));
        }
        Ok(())
    }

    /// Runs one request: a panic fails it with [`TierError::Panicked`] and leaves the session as it
    /// was (its maps change only after the work that can fail).
    pub(super) fn run(&mut self, req: Request) -> Reply {
        let name = req.name();
        let blocks = request_blocks(&req);
        let span = tracing::debug_span!("request", kind = name, blocks, pid = %ShowPid(self.pid));
        let _entered = span.enter();
        let start = std::time::Instant::now();
        let reply = self.run_request(req, name);
        tracing::debug!(
            "process {}: {name} ({blocks} keys/blocks) -> {} in {} us",
            ShowPid(self.pid),
            reply_summary(&reply),
            start.elapsed().as_micros(),
        );
        if let Reply::Error(WireError::LimitExceeded { .. }) = &reply {
            ClientCounters::add(&self.counters.refused, 1);
        }
        self.publish();
        reply
    }

    /// What this session holds now, into its counters (after each request).
    fn publish(&self) {
        let c = &self.counters;
        ClientCounters::set(&c.lease_handles, self.lease_handles);
        ClientCounters::set(&c.leased_blocks, self.leased_blocks);
        ClientCounters::set(&c.hints, self.hints.len());
        ClientCounters::set(&c.copies, self.copies());
    }

    fn run_request(&mut self, req: Request, name: &'static str) -> Reply {
        if crate::seeded::seeded("request-panic-unwinds") {
            return self.handle(req).unwrap_or_else(|e| Reply::Error(WireError::from(&e)));
        }
        match catch_unwind(AssertUnwindSafe(|| self.handle(req))) {
            Ok(Ok(reply)) => reply,
            Ok(Err(e)) => {
                if matches!(e, TierError::LimitExceeded { .. }) {
                    tracing::info!("process {}: refused {name}: {e}", ShowPid(self.pid));
                } else {
                    tracing::debug!("{name} failed: {e}");
                }
                Reply::Error(WireError::from(&e))
            }
            Err(payload) => {
                let message = panic_message(&*payload);
                tracing::error!("process {}: request {name} panicked: {message}", ShowPid(self.pid));
                Reply::Error(WireError::Panicked { request: name.into(), message })
            }
        }
    }

    fn handle(&mut self, req: Request) -> Result<Reply, TierError> {
        if self.shared.panic_hook.get().is_some_and(|h| h(&req)) {
            panic!("a panic injected into {} (Server::panic_on_requests)", req.name());
        }
        let core = self.shared.core.clone();
        let block_bytes = core.geometry().block_bytes();
        Ok(match req {
            Request::Hello { .. } => return Err(misuse("a second hello on a connection that said hello")),
            Request::Attach => Reply::Attached { rank: core.next_rank_id() },
            Request::Query { keys, uses } => {
                self.check_keys(keys.len())?;
                if uses > self.shared.limits.lease_uses {
                    return Err(limit(Limit::LeaseUses, uses as usize, self.shared.limits.lease_uses as usize));
                }
                self.check_lease_handle()?;
                // A prompt's chained keys never repeat: the lease is a prefix, so it ends before
                // the first repeated key and names each slot once.
                let mut seen = HashSet::with_capacity(keys.len().min(4096));
                let distinct = keys.iter().take_while(|k| seen.insert(**k)).count();
                self.check_leased_blocks(distinct)?;
                let lease = self.query_lease(&keys[..distinct], uses);
                let c = &self.counters;
                ClientCounters::add(&c.queries, 1);
                ClientCounters::add(&c.hit_blocks, lease.len() as u64);
                ClientCounters::add(&c.miss_blocks, distinct.saturating_sub(lease.len()) as u64);
                if lease.is_settled() {
                    return Ok(Self::leased(0, &lease));
                }
                let reply_blocks = Self::leased(0, &lease);
                let n = lease.len();
                let id = self.shared.register(lease);
                *self.leases.entry(id).or_default() += 1;
                self.lease_handles += 1;
                self.lease_sizes.insert(id, n);
                self.leased_blocks += n;
                match reply_blocks {
                    Reply::Leased { blocks, sources, .. } => Reply::Leased { lease: id, blocks, sources },
                    r => r,
                }
            }
            Request::OpenLease { instance, lease: id } => {
                if instance != self.shared.welcome.instance {
                    return Err(TierError::ForeignLease);
                }
                self.check_lease_handle()?;
                let reply = {
                    let mut leases = self.shared.leases.lock().unwrap_or_else(|p| p.into_inner());
                    let e = leases.get_mut(&id).ok_or(TierError::LeaseSettled)?;
                    self.check_leased_blocks(e.lease.len())?;
                    e.holders += 1;
                    Self::leased(id, &e.lease)
                };
                let n = match &reply {
                    Reply::Leased { blocks, .. } => blocks.len(),
                    _ => 0,
                };
                *self.leases.entry(id).or_default() += 1;
                self.lease_handles += 1;
                self.lease_sizes.insert(id, n);
                self.leased_blocks += n;
                reply
            }
            Request::DropLease { lease: id } => {
                if let Some(n) = self.leases.get_mut(&id) {
                    *n -= 1;
                    let size = self.lease_sizes.get(&id).copied().unwrap_or(0);
                    if *n == 0 {
                        self.leases.remove(&id);
                        self.lease_sizes.remove(&id);
                    }
                    self.leased_blocks = self.leased_blocks.saturating_sub(size);
                    self.lease_handles -= 1;
                    self.shared.drop_handles(id, 1);
                }
                Reply::Done
            }
            Request::LeaseInfo { lease } => {
                let l = self.lease(lease)?;
                Reply::LeaseInfo { settled: l.is_settled(), expired: l.is_expired(), uses_left: l.uses_left() }
            }
            Request::ReleaseLease { lease } => Reply::Bool(self.lease(lease)?.release()),
            Request::ConsumeUse { lease } => {
                self.lease(lease)?.consume_without_copy();
                Reply::Done
            }
            Request::PrepareSave { keys, prefix, prefix_depth, parent } => {
                self.check_keys(keys.len())?;
                self.check_copy()?;
                // At most one slot a key: taken from the process's bound before anything is
                // reserved, the unused part given back once the reservation is known.
                // (never more than the pool holds: a larger save is the tier's CannotFit).
                let want = keys.len().min(core.pool().capacity() as usize);
                self.shared.take_slots(self.pid, want)?;
                let mut opts = SaveOptions::new().fit(if prefix { Fit::Prefix } else { Fit::AllOrNothing });
                opts.prefix_depth = prefix_depth;
                opts.parent = parent;
                let p = match prepare_save(&core, &keys, &opts) {
                    Ok(p) => p,
                    Err(e) => {
                        self.shared.give_slots(self.pid, want);
                        return Err(e);
                    }
                };
                let reserved = p.reservation.len().min(want);
                self.shared.give_slots(self.pid, want - reserved);
                // The bound over every process and the fair shares count the slots the save
                // reserved (its keys already resident or in flight take none): over them, the
                // reservation is dropped as a failed save's is.
                if let Err(e) = self.shared.check_writing(self.pid, reserved) {
                    drop(p);
                    self.shared.give_slots(self.pid, reserved);
                    return Err(e);
                }
                let slots: Vec<u32> = p.reservation.entries().iter().map(|r| r.slot.0).collect();
                let save = if slots.is_empty() {
                    0
                } else {
                    let id = self.id();
                    self.saves.insert(id, PendingSave { reservation: Some(p.reservation) });
                    id
                };
                Reply::SavePrepared {
                    save,
                    saving: p.saving.iter().map(|&i| i as u32).collect(),
                    slots,
                    resident: p.resident as u32,
                    in_flight: p.in_flight as u32,
                    duplicates: p.duplicates as u32,
                    dropped: p.dropped as u32,
                }
            }
            Request::FinishSave { save, outcome, latency_ns } => {
                let reservation = self
                    .saves
                    .remove(&save)
                    .ok_or_else(|| misuse(format!("no save {save} in flight on this connection")))?
                    .take();
                let blocks = reservation.len() as u64;
                match outcome {
                    Outcome::Done => {
                        reservation.commit();
                        self.shared.give_slots(self.pid, blocks as usize);
                    }
                    Outcome::Failed | Outcome::NotSubmitted => {
                        drop(reservation);
                        self.shared.give_slots(self.pid, blocks as usize);
                    }
                    Outcome::Unknown | Outcome::SubmitPanicked => {
                        self.parked.extend_from_slice(reservation.entries());
                        reservation.quarantine();
                    }
                }
                let bytes = if outcome == Outcome::NotSubmitted { 0 } else { blocks * block_bytes };
                self.record_copy(&core.counters, Direction::Save, blocks, bytes, outcome, latency_ns);
                Reply::Done
            }
            Request::Restore { lease, blocks } => {
                let l = self.lease(lease)?;
                self.check_copy()?;
                let mut hold = l.begin_restore(blocks as usize)?;
                let pins = hold.take_pins();
                let slots = pins.slots().iter().map(|s| s.0).collect();
                let id = self.id();
                self.restores.insert(id, PendingRestore { hold: Some(hold), pins: Some(pins) });
                Reply::Restoring { restore: id, slots }
            }
            Request::RestoreSubmitted { restore } => {
                if let Some(hold) = self.restores.get_mut(&restore).and_then(|r| r.hold.take()) {
                    hold.submitted();
                }
                Reply::Done
            }
            Request::FinishRestore { restore, outcome, latency_ns } => {
                let (hold, pins) = self
                    .restores
                    .remove(&restore)
                    .ok_or_else(|| misuse(format!("no restore {restore} in flight on this connection")))?
                    .take();
                let blocks = pins.len() as u64;
                match outcome {
                    Outcome::NotSubmitted => {
                        // Pins first, then the use goes back (as an unsubmitted hold does).
                        drop(pins);
                        drop(hold);
                    }
                    Outcome::Done | Outcome::Failed => {
                        if let Some(c) = hold {
                            c.submitted();
                        }
                        drop(pins);
                    }
                    Outcome::Unknown => {
                        // The pins are parked before anything that may panic: an unwind in the
                        // hold's settling cannot unpin under a live copy.
                        core.record_quarantined_pins(pins.len());
                        self.parked_pins.push(pins);
                        if let Some(c) = hold {
                            c.submitted();
                        }
                    }
                    Outcome::SubmitPanicked => {
                        // The backend may have queued the copy: the pins are parked as for an
                        // unknown outcome; the call failed, so the use goes back (as in process).
                        core.record_quarantined_pins(pins.len());
                        self.parked_pins.push(pins);
                        drop(hold);
                    }
                }
                let bytes = if outcome == Outcome::NotSubmitted { 0 } else { blocks * block_bytes };
                self.record_copy(&core.counters, Direction::Restore, blocks, bytes, outcome, latency_ns);
                Reply::Done
            }
            Request::Contains { key } => Reply::Bool(self.shared.tier.contains(&key)),
            Request::Evict { blocks } => {
                // Evicting more than the pool holds is evicting all of it: the tier never sees a
                // count above its capacity.
                let n = blocks.min(core.pool().capacity() as u64) as usize;
                Reply::Count(self.shared.tier.evict(n) as u64)
            }
            Request::Hint { keys, ttl_ms } => self.hint(&keys, ttl_ms)?,
            Request::WithdrawHint { id } => {
                // Only this connection's own hints: another's id is no hint of this connection.
                match self.hints.iter().position(|h| h.id == id) {
                    Some(i) => {
                        self.hints.swap_remove(i);
                        Reply::Bool(self.shared.tier.withdraw_hint(crate::tier::HintId::from_number(id)))
                    }
                    None => Reply::Bool(false),
                }
            }
            Request::LiveHints => Reply::Count(self.shared.tier.live_hints() as u64),
            Request::ExpireLeases => Reply::Count(self.shared.tier.expire_leases() as u64),
            Request::Stats => Reply::Stats(self.shared.tier.stats().into()),
            Request::Clients => Reply::Clients(self.shared.clients.rows(self.client_id)),
            Request::SsdStats => Reply::SsdStats(self.shared.tier.ssd_stats().map(Into::into)),
            Request::Audit { keys } => {
                self.check_keys(keys.len())?;
                Reply::Audit(core.audit(&keys).map(|a| WireAudit {
                    free: a.free as u64,
                    writing: a.writing as u64,
                    ready: a.ready as u64,
                    evicting: a.evicting as u64,
                    pinned: a.pinned as u64,
                }))
            }
        })
    }

    /// A hint on the distinct `keys`, owned by this connection and bounded in count and keys.
    fn hint(&mut self, keys: &[ContentKey], ttl_ms: u64) -> Result<Reply, TierError> {
        self.check_keys(keys.len())?;
        let now = Instant::now();
        // The tier drops expired hints by itself; they no longer count against this connection.
        self.hints.retain(|h| h.expires.is_none_or(|t| t > now));
        let limits = &self.shared.limits;
        if self.hints.len() >= limits.hints_per_connection {
            return Err(limit(Limit::HintsPerConnection, self.hints.len() + 1, limits.hints_per_connection));
        }
        let mut seen = HashSet::with_capacity(keys.len().min(4096));
        let distinct: Vec<ContentKey> = keys.iter().copied().filter(|k| seen.insert(*k)).collect();
        let held: usize = self.hints.iter().map(|h| h.keys).sum();
        if held + distinct.len() > limits.hint_keys_per_connection {
            return Err(limit(Limit::HintKeysPerConnection, held + distinct.len(), limits.hint_keys_per_connection));
        }
        // The tier cuts a hint at MAX_HINT_TTL; the connection counts it no longer than that.
        let ttl = Duration::from_millis(ttl_ms).min(crate::tier::MAX_HINT_TTL);
        // Refused typed over the daemon's hint bytes (every connection's hints together).
        let id = self.shared.tier.try_hint(&distinct, ttl)?.get();
        self.hints.push(OwnedHint { id, keys: distinct.len(), expires: now.checked_add(ttl) });
        ClientCounters::add(&self.counters.hints_given, 1);
        Ok(Reply::Count(id))
    }

    /// Ends the session (see the type's docs); idempotent.
    fn end(&mut self) {
        self.shared.clients.unregister(self.client_id);
        let leases = std::mem::take(&mut self.leases);
        let shared = self.shared.clone();
        if let Err(p) = catch_unwind(AssertUnwindSafe(move || {
            for (id, n) in leases {
                shared.drop_handles(id, n);
            }
        })) {
            tracing::error!(
                "process {}: dropping its lease handles panicked: {}",
                ShowPid(self.pid),
                panic_message(&*p)
            );
        }
        self.lease_handles = 0;
        self.lease_sizes.clear();
        self.leased_blocks = 0;
        for h in std::mem::take(&mut self.hints) {
            if !crate::seeded::seeded("hints-outlive-connection") {
                self.shared.tier.withdraw_hint(crate::tier::HintId::from_number(h.id));
            }
        }
        let core = self.shared.core.clone();
        // Each step runs under catch_unwind (this may run while the thread unwinds: a panic here
        // would abort the daemon); whatever a panicking step left is withheld for good by the
        // pending copies' drops.
        let restores: Vec<PendingRestore> = self.restores.drain().map(|(_, r)| r).collect();
        for r in restores {
            let (hold, pins) = r.take();
            // The pins are parked first; the copy may have been submitted: the use is spent.
            core.record_quarantined_pins(pins.len());
            self.parked_pins.push(pins);
            if let Some(c) = hold {
                if let Err(p) = catch_unwind(AssertUnwindSafe(|| c.submitted())) {
                    tracing::error!(
                        "process {:?}: settling a restore's use panicked: {}",
                        self.pid,
                        panic_message(&*p)
                    );
                }
            }
        }
        let saves: Vec<PendingSave> = self.saves.drain().map(|(_, s)| s).collect();
        for s in saves {
            let reservation = s.take();
            self.parked.extend_from_slice(reservation.entries());
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| reservation.quarantine())) {
                tracing::error!(
                    "process {}: withholding a save's slots panicked: {}",
                    ShowPid(self.pid),
                    panic_message(&*p)
                );
            }
        }
        let parked = Parked {
            pid: self.pid,
            pidfd: self.pidfd.take(),
            reserved: std::mem::take(&mut self.parked),
            pins: std::mem::take(&mut self.parked_pins),
        };
        if parked.is_empty() {
            return;
        }
        if self.gone_at_end {
            self.shared.release_parked(parked);
            return;
        }
        match &parked.pidfd {
            Some(fd) if exited(fd) => self.shared.release_parked(parked),
            Some(_) => {
                tracing::info!(
                    "process {} disconnected with {} slots being written and {} pinned restores: \
                     withheld until it exits",
                    ShowPid(parked.pid),
                    parked.reserved.len(),
                    parked.pins.len()
                );
                self.shared.park(parked);
            }
            None => {
                tracing::warn!(
                    "process {} disconnected with copies in flight and no pidfd: {} slots and {} restores' pins \
                     are withheld for good",
                    ShowPid(parked.pid),
                    parked.reserved.len(),
                    parked.pins.len()
                );
                std::mem::forget(parked);
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if !crate::seeded::seeded("session-drop-skips-close") {
            self.end();
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

/// Blocks (or keys) a request names, for its debug span (0 for requests that name none).
/// A reply in a few words, for the per-request debug line: its kind, and an error's text.
fn reply_summary(reply: &Reply) -> String {
    match reply {
        Reply::Error(e) => format!("error {e:?}"),
        Reply::Bool(b) => format!("Bool({b})"),
        Reply::Count(n) => format!("Count({n})"),
        Reply::Leased { blocks, .. } => format!("Leased({} blocks)", blocks.len()),
        Reply::SavePrepared { saving, .. } => format!("SavePrepared({} to copy)", saving.len()),
        Reply::Restoring { slots, .. } => format!("Restoring({} slots)", slots.len()),
        Reply::Welcome(_) => "Welcome".into(),
        Reply::Done => "Done".into(),
        Reply::Attached { .. } => "Attached".into(),
        Reply::LeaseInfo { .. } => "LeaseInfo".into(),
        Reply::Stats(_) => "Stats".into(),
        Reply::Audit(_) => "Audit".into(),
        Reply::Clients(c) => format!("Clients({})", c.len()),
        Reply::SsdStats(s) => format!("SsdStats({})", if s.is_some() { "some" } else { "none" }),
    }
}

fn request_blocks(req: &Request) -> u64 {
    match req {
        Request::Query { keys, .. }
        | Request::PrepareSave { keys, .. }
        | Request::Hint { keys, .. }
        | Request::Audit { keys, .. } => keys.len() as u64,
        Request::Restore { blocks, .. } => *blocks as u64,
        Request::Evict { blocks } => *blocks,
        Request::Contains { .. } => 1,
        _ => 0,
    }
}

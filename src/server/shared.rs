//! What the daemon holds for all its connections ([`Shared`]): the tier and its welcome, the lease
//! table and its handles, the slots and pins withheld for processes that may still copy
//! ([`Parked`]), each process's slots held, the connection and session counts ([`ConnSlot`],
//! [`SessionCount`]), the refusals over a bound and each session's own counters.

use super::clients::Clients;
use super::limits::{limit, Limits};
use super::peer::{exited, ShowPid};
use crate::error::{Limit, TierError};
use crate::remote::proto::{self, Request, WireError};
use crate::tier::core::{Core, Reserved};
use crate::tier::lease::Lease;
use crate::tier::pins::SlotPins;
use crate::tier::HostTier;
use std::collections::HashMap;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

pub(super) struct LeaseEntry {
    pub(super) lease: Lease,
    /// Handles on the lease, over all connections.
    pub(super) holders: u64,
}

/// Slots and pins withheld for a process's copies until the process is gone.
pub(super) struct Parked {
    pub(super) pid: Option<u32>,
    pub(super) pidfd: Option<OwnedFd>,
    pub(super) reserved: Vec<Reserved>,
    pub(super) pins: Vec<SlotPins>,
}

impl Parked {
    pub(super) fn is_empty(&self) -> bool {
        self.reserved.is_empty() && self.pins.is_empty()
    }

    /// Returns every slot and pin to the tier (the process is gone).
    fn release(self, core: &Core) {
        let n: usize = self.pins.iter().map(|p| p.len()).sum();
        drop(self.pins);
        core.release_quarantined_pins(n);
        let slots = self.reserved.len();
        for r in self.reserved {
            core.release_quarantined(r);
        }
        tracing::info!("process {} is gone: released {slots} slots it was writing and {n} pins", ShowPid(self.pid));
    }
}

type PanicHook = Box<dyn Fn(&Request) -> bool + Send + Sync>;

pub(super) struct Shared {
    pub(super) tier: HostTier,
    pub(super) core: Arc<Core>,
    pub(super) welcome: proto::Welcome,
    pub(super) limits: Limits,
    pub(super) leases: Mutex<HashMap<u64, LeaseEntry>>,
    pub(super) parked: Mutex<Vec<Parked>>,
    /// Slots each process (by pid) holds being written or withheld, over its connections.
    slots_held: Mutex<HashMap<Option<u32>, usize>>,
    /// [`Limits::slots_per_process`] resolved against the pool's capacity.
    slot_bound: usize,
    /// [`Limits::writing_slots`] resolved against the pool's capacity.
    writing_bound: usize,
    /// Connections open now (each counted from accept until its thread ends).
    pub(super) live: AtomicUsize,
    /// Connections open now by each process (pid from `SO_PEERCRED`), counted like [`Shared::live`].
    live_by_pid: Mutex<HashMap<u32, usize>>,
    /// Refused connections kept open a moment so the refusal reaches the client.
    pub(super) refused: Mutex<Vec<(Arc<UnixStream>, Instant)>>,
    /// Connections accepted since the daemon started (refused ones included).
    pub(super) accepted: AtomicU64,
    /// Sessions open now (a connection whose hello was accepted, until it ends).
    pub(super) sessions: AtomicUsize,
    /// Sessions begun since the daemon started.
    pub(super) sessions_begun: AtomicU64,
    /// Requests and connections refused over a bound, by bound (in order of first refusal).
    pub(super) refusals: Mutex<Vec<(Limit, u64)>>,
    /// Each live session's own counters ([`Clients`]).
    pub(super) clients: Clients,
    /// Tests: requests for which this returns true panic in the daemon (see
    /// [`Server::panic_on_requests`](super::Server::panic_on_requests)).
    pub(super) panic_hook: OnceLock<PanicHook>,
    /// Where queries go for the keys after the local prefix, and how long each may take
    /// ([`Server::fetch_from_peers`](super::Server::fetch_from_peers)).
    #[cfg(feature = "peers")]
    pub(super) peers: OnceLock<(Arc<crate::PeerSet>, std::time::Duration)>,
}

impl Shared {
    pub(super) fn new(tier: HostTier, limits: Limits) -> Shared {
        let core = tier.core().clone();
        let g = core.geometry();
        let pool = core.pool();
        let welcome = proto::Welcome {
            version: proto::PROTOCOL_VERSION,
            instance: random_u64(),
            pid: std::process::id(),
            model: g.model().to_string(),
            page_tokens: g.page_tokens(),
            shard: g.shard(),
            arenas: g
                .arenas()
                .iter()
                .map(|a| proto::WireArena {
                    name: a.name.clone(),
                    bytes_per_page: a.bytes_per_page,
                    page_stride: a.page_stride,
                    pages: a.pages,
                    fused: match a.placement {
                        crate::Placement::Own => None,
                        crate::Placement::Fused { buffer, offset } => Some((buffer, offset)),
                    },
                })
                .collect(),
            namespace: g.namespace(),
            slot_bytes: g.slot_bytes(),
            capacity: pool.capacity(),
            mapped_bytes: pool.mapped_bytes(),
            backing: pool.backing().name().to_string(),
            policy: core.policy().name().to_string(),
            limits: limits.wire(),
        };
        let slot_bound = match limits.slots_per_process {
            0 => (pool.capacity() as usize / 2).max(1),
            n => n,
        };
        let writing_bound = match limits.writing_slots {
            0 => (pool.capacity() as usize).max(1),
            n => n,
        };
        // Every connection's hints share one budget of bytes in the tier's table.
        core.set_hint_budget(limits.hint_bytes);
        Shared {
            tier,
            core,
            welcome,
            limits,
            leases: Mutex::new(HashMap::new()),
            parked: Mutex::new(Vec::new()),
            slots_held: Mutex::new(HashMap::new()),
            slot_bound,
            writing_bound,
            live: AtomicUsize::new(0),
            live_by_pid: Mutex::new(HashMap::new()),
            refused: Mutex::new(Vec::new()),
            accepted: AtomicU64::new(0),
            sessions: AtomicUsize::new(0),
            sessions_begun: AtomicU64::new(0),
            refusals: Mutex::new(Vec::new()),
            clients: Clients::new(),
            panic_hook: OnceLock::new(),
            #[cfg(feature = "peers")]
            peers: OnceLock::new(),
        }
    }

    /// Counts `e` among the refusals if it is one over a bound ([`WireError::LimitExceeded`]).
    pub(super) fn note_refusal(&self, e: &WireError) {
        let WireError::LimitExceeded { limit, .. } = e else { return };
        let mut r = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        match r.iter_mut().find(|(l, _)| l == limit) {
            Some((_, n)) => *n += 1,
            None => r.push((*limit, 1)),
        }
    }

    /// Takes `n` slots of process `pid`'s bound, or refuses with [`Limit::SlotsPerProcess`].
    pub(super) fn take_slots(&self, pid: Option<u32>, n: usize) -> Result<(), TierError> {
        let mut held = self.slots_held.lock().unwrap_or_else(|p| p.into_inner());
        let h = held.entry(pid).or_default();
        if h.saturating_add(n) > self.slot_bound && !crate::seeded::seeded("slots-unbounded-per-process") {
            return Err(limit(Limit::SlotsPerProcess, h.saturating_add(n), self.slot_bound));
        }
        *h += n;
        Ok(())
    }

    /// Checks the `n` slots just reserved for process `pid` (counted in its holdings by
    /// [`Shared::take_slots`]) against the bound over every process and the process's fair share
    /// ([`Limits::writing_slots`]): refused with [`Limit::WritingSlots`] if they take the slots held
    /// past the bound, or take the process past its fair share while that leaves another connected
    /// process less than its own share unheld. The caller drops the reservation when refused.
    pub(super) fn check_writing(&self, pid: Option<u32>, n: usize) -> Result<(), TierError> {
        // Seeded bug (tests only): `writing-slots-unbounded` bounds each process on its own only.
        if crate::seeded::seeded("writing-slots-unbounded") {
            return Ok(());
        }
        // Lock order: `slots_held`, then `live_by_pid` (which nothing takes the other way round).
        let held = self.slots_held.lock().unwrap_or_else(|p| p.into_inner());
        let bound = self.writing_bound;
        // What was held before these `n`.
        let total = held.values().sum::<usize>().saturating_sub(n);
        let h = held.get(&pid).copied().unwrap_or(0).saturating_sub(n);
        if total.saturating_add(n) > bound {
            return Err(limit(Limit::WritingSlots, total.saturating_add(n), bound));
        }
        let live: Vec<Option<u32>> = {
            let by_pid = self.live_by_pid.lock().unwrap_or_else(|p| p.into_inner());
            by_pid.keys().map(|&p| Some(p)).collect()
        };
        // The processes that share the bound: those connected and those holding slots (a
        // disconnected one whose copies are withheld), this one included.
        let mut procs: Vec<Option<u32>> = live.iter().copied().chain(held.keys().copied()).collect();
        procs.push(pid);
        procs.sort_unstable();
        procs.dedup();
        let share = (bound / procs.len()).max(1);
        if h.saturating_add(n) <= share {
            return Ok(());
        }
        // Past its share: only from what the other connected processes' unheld shares leave.
        let reserved: usize =
            live.iter().filter(|&&q| q != pid).map(|q| share.saturating_sub(held.get(q).copied().unwrap_or(0))).sum();
        let room = bound.saturating_sub(total.saturating_add(reserved));
        if n > room {
            return Err(limit(Limit::WritingSlots, h.saturating_add(n), share.max(h.saturating_add(room))));
        }
        Ok(())
    }

    /// Slots process `pid` may still take of its bound.
    #[cfg(feature = "peers")]
    pub(super) fn slot_room(&self, pid: Option<u32>) -> usize {
        let held = self.slots_held.lock().unwrap_or_else(|p| p.into_inner());
        self.slot_bound.saturating_sub(held.get(&pid).copied().unwrap_or(0))
    }

    /// Gives `n` slots back to process `pid`'s bound.
    pub(super) fn give_slots(&self, pid: Option<u32>, n: usize) {
        let mut held = self.slots_held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = held.get_mut(&pid) {
            *h = h.saturating_sub(n);
            if *h == 0 {
                held.remove(&pid);
            }
        }
    }

    /// Returns what a gone process withheld to the tier and its slots to its bound.
    pub(super) fn release_parked(&self, p: Parked) {
        let (pid, slots) = (p.pid, p.reserved.len());
        p.release(&self.core);
        self.give_slots(pid, slots);
    }

    /// Withholds `p` until its process exits: merged into the entry of the same process (one
    /// pidfd a process, however many connections it parked from); an entry of an exited process
    /// with the same pid (a reused pid) is released first.
    pub(super) fn park(&self, mut p: Parked) {
        let gone = {
            let mut parked = self.parked.lock().unwrap_or_else(|e| e.into_inner());
            let mut gone = None;
            let same = if crate::seeded::seeded("parked-pidfd-per-connection") {
                None
            } else {
                parked.iter().position(|q| q.pid == p.pid)
            };
            if let Some(i) = same {
                if parked[i].pidfd.as_ref().is_some_and(exited) {
                    gone = Some(parked.swap_remove(i));
                } else {
                    let q = &mut parked[i];
                    q.reserved.append(&mut p.reserved);
                    q.pins.append(&mut p.pins);
                    return; // p's own pidfd closes here
                }
            }
            parked.push(p);
            gone
        };
        if let Some(g) = gone {
            self.release_parked(g);
        }
    }

    /// Drops `n` handles on lease `id`; the lease settles (dropped) with the last one.
    pub(super) fn drop_handles(&self, id: u64, n: u64) {
        let gone = {
            let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
            match leases.get_mut(&id) {
                Some(e) if e.holders > n => {
                    e.holders -= n;
                    None
                }
                Some(_) => leases.remove(&id),
                None => None,
            }
        };
        drop(gone); // settles outside the lock
    }

    /// Registers `lease` under a new random id with one handle.
    pub(super) fn register(&self, lease: Lease) -> u64 {
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let id = if crate::seeded::seeded("sequential-lease-ids") {
                leases.keys().max().map_or(1, |m| m + 1)
            } else {
                random_u64()
            };
            if id != 0 && !leases.contains_key(&id) {
                leases.insert(id, LeaseEntry { lease, holders: 1 });
                return id;
            }
        }
    }
}

/// One connection counted in [`Shared::live`] (and in [`Shared::live_by_pid`] under its
/// process's pid, once [`ConnSlot::count_process`] took it) until dropped, however its thread ends.
pub(super) struct ConnSlot(Arc<Shared>, Option<u32>);

/// One session counted in [`Shared::sessions`] until dropped, however its thread ends.
pub(super) struct SessionCount(Arc<Shared>);

impl SessionCount {
    pub(super) fn new(shared: Arc<Shared>) -> SessionCount {
        shared.sessions.fetch_add(1, Ordering::Relaxed);
        shared.sessions_begun.fetch_add(1, Ordering::Relaxed);
        SessionCount(shared)
    }
}

impl Drop for SessionCount {
    fn drop(&mut self) {
        self.0.sessions.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ConnSlot {
    /// A connection counted in [`Shared::live`] by the caller, not yet under a process.
    pub(super) fn new(shared: Arc<Shared>) -> ConnSlot {
        ConnSlot(shared, None)
    }

    /// Counts this connection against process `pid`'s [`Limits::connections_per_process`]; over the
    /// bound, counts nothing and returns how many the process would have open (with this one).
    pub(super) fn count_process(&mut self, pid: u32) -> Result<(), usize> {
        let mut by_pid = self.0.live_by_pid.lock().unwrap_or_else(|p| p.into_inner());
        let n = by_pid.entry(pid).or_default();
        if *n >= self.0.limits.connections_per_process && !crate::seeded::seeded("no-per-process-connection-limit") {
            let asked = *n + 1;
            if *n == 0 {
                by_pid.remove(&pid);
            }
            return Err(asked);
        }
        *n += 1;
        self.1 = Some(pid);
        Ok(())
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        if let Some(pid) = self.1 {
            let mut by_pid = self.0.live_by_pid.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = by_pid.get_mut(&pid) {
                *n -= 1;
                if *n == 0 {
                    by_pid.remove(&pid);
                }
            }
        }
        self.0.live.fetch_sub(1, Ordering::AcqRel);
    }
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        // SAFETY: getrandom writes at most `8 - got` bytes at `b[got..]`, inside `b`.
        let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), 8 - got, 0) };
        if n > 0 {
            got += n as usize;
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            break;
        }
    }
    if got == 8 {
        return u64::from_le_bytes(b);
    }
    // No getrandom (a kernel before 3.17): /dev/urandom.
    let mut f = std::fs::File::open("/dev/urandom").expect("kvtierd needs getrandom or /dev/urandom for lease ids");
    f.read_exact(&mut b).expect("reading /dev/urandom");
    u64::from_le_bytes(b)
}

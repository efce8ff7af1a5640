//! [`NixlTransport`]: the [`PeerTransport`] over NIXL (feature `nixl`). Bytes move only through
//! NIXL's UCX backend (shared memory, TCP, RDMA: whatever UCX selects); kvtier adds no transport.
//!
//! - **Registration**: one NIXL agent per transport, with one UCX backend; the whole host pool
//!   (its mapping, [`crate::PoolRegion`]) is registered once as DRAM. The pool keeps a guard in its
//!   registration list ([`HostPool::with_registrations`]) that deregisters it before the mapping
//!   goes, waiting for reads in flight; a read after that fails with [`TransportError::Backend`].
//! - **Descriptor** ([`PeerTransport::local_descriptor`]), little-endian, version 1:
//!   `b"KVTN"` (4 B), version `u16` = 1, reserved `u16` = 0, pool base address `u64`, registered
//!   length `u64` (bytes), metadata length `u32` (bytes), then the agent's NIXL metadata. 28 B of
//!   header; nothing may follow the metadata.
//! - **Read**: every [`BlockRead`] of a batch is range-checked against both pools, then the batch
//!   is one NIXL READ request (local descriptors in this pool, remote ones at the peer's base plus
//!   the offset), posted and polled until it completes or the deadline passes. Past the deadline
//!   the read returns at once, but NIXL's cancel of a UCX transfer in flight is not synchronous, so
//!   the request is handed to a drain thread that polls it until NIXL reports it over (completed
//!   or failed), and only then releases it and drops the read's [`ReadDone`]: the caller keeps
//!   the destination slots quarantined until then. Removing the peer and deregistering the pool
//!   wait for those transfers (up to [`DRAIN_LIMIT`]; past it the slots stay withheld for good).
//! - **Errors**: nixl-sys 1.5.1's C API reports every backend failure of a transfer, the peer's
//!   disconnection (`NIXL_ERR_REMOTE_DISCONNECT`) included, as one status; a transfer that was
//!   accepted and then failed is reported as [`TransportError::Disconnected`], one NIXL refused
//!   before posting as [`TransportError::Backend`].

/// The nixl-sys crate kvtier links (`=1.5.1`, stub API: NIXL loaded at run time), for code that
/// drives NIXL next to [`NixlTransport`] (kvtier's raw-NIXL benchmark) with the same version.
pub use nixl_sys;

use super::transport::{BlockRead, PeerTransport, ReadDone, TransportError, TransportPeer};
use crate::slab::HostPool;
use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NixlError, OptArgs, RegistrationHandle,
    ThreadSync, XferDescList, XferOp, XferStatus,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

/// The longest a drain waits for a transfer past its deadline to be over; past it the request is
/// released and the read's [`ReadDone`] kept for good (its slots withheld, never reused).
pub(crate) const DRAIN_LIMIT: Duration = Duration::from_secs(60);

/// The first 4 bytes of a [`NixlTransport`] descriptor.
const MAGIC: [u8; 4] = *b"KVTN";
/// The descriptor version this build writes and reads.
const VERSION: u16 = 1;
/// Bytes before the metadata: magic, version, reserved, base, length, metadata length.
const HEADER_BYTES: usize = 4 + 2 + 2 + 8 + 8 + 4;

/// The message of [`TransportError::Backend`] when nixl-sys found no NIXL runtime.
const RUNTIME_MISSING: &str = "NIXL runtime not found: libnixl_capi.so did not load; set LD_LIBRARY_PATH to the \
     folder holding libnixl_capi.so (the nixl-cu12 wheel's .nixl_cu12.mesonpy.libs) and NIXL_PLUGIN_DIR to its \
     plugins/ folder";

/// The registered host pool, as nixl-sys's registration takes it.
#[derive(Debug)]
struct PoolMemory {
    /// Address of the pool's first byte.
    base: usize,
    /// Registered bytes from `base`.
    len: usize,
}

impl MemoryRegion for PoolMemory {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.base as *const u8
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for PoolMemory {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

/// A peer loaded from its descriptor.
#[derive(Debug)]
struct Peer {
    /// The peer's NIXL agent name (from its metadata).
    agent: String,
    /// Address of the peer's registered pool, in the peer's address space.
    base: u64,
    /// Registered bytes of the peer's pool.
    len: u64,
}

/// What the transport and the pool's guard share.
struct Shared {
    agent: Agent,
    /// The UCX backend (owned by the agent; kept to name it in every request).
    backend: Backend,
    /// Address of this pool's first byte.
    base: usize,
    /// Registered bytes of this pool.
    len: u64,
    /// The pool's registration; `None` once the pool or the transport dropped it. Reads hold it
    /// shared for their whole run, so the pool's memory stays mapped under a transfer.
    registration: RwLock<Option<RegistrationHandle>>,
    /// Loaded peers. Reads hold the map shared, so [`PeerTransport::remove_peer`] (which
    /// invalidates the peer's metadata, and with it NIXL's requests to it) waits for them.
    peers: RwLock<HashMap<u64, Peer>>,
    next_peer: AtomicU64,
    /// Transfers past their deadline still draining, per peer agent name.
    draining: Mutex<HashMap<String, usize>>,
    /// Signalled when a drain ends.
    drained: Condvar,
}

impl Shared {
    /// Waits (up to [`DRAIN_LIMIT`]) until no transfer to `agent` (any agent: `None`) is draining.
    fn wait_drained(&self, agent: Option<&str>) {
        let until = Instant::now() + DRAIN_LIMIT;
        let mut d = self.draining.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let busy = match agent {
                Some(a) => d.get(a).is_some_and(|&n| n > 0),
                None => d.values().any(|&n| n > 0),
            };
            let left = until.saturating_duration_since(Instant::now());
            if !busy || left.is_zero() {
                return;
            }
            d = self.drained.wait_timeout(d, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Deregisters the pool (waiting for reads in flight and transfers draining); later reads
    /// fail.
    fn deregister(&self) {
        self.wait_drained(None);
        let taken = self.registration.write().unwrap_or_else(|e| e.into_inner()).take();
        drop(taken); // RegistrationHandle's drop deregisters
    }
}

/// Kept in the pool's registration list: deregisters the pool from NIXL before it is unmapped.
struct PoolGuard(Weak<Shared>);

impl Drop for PoolGuard {
    fn drop(&mut self) {
        if let Some(shared) = self.0.upgrade() {
            shared.deregister();
        }
    }
}

/// The NIXL implementation of [`PeerTransport`] (feature `nixl`): one NIXL agent with the UCX
/// backend and this instance's whole host pool registered (see the module docs for the
/// descriptor's encoding and the error mapping).
///
/// The pool must be the one whose offsets [`BlockRead::local_offset`] names. NIXL needs its
/// runtime at run time (`libnixl_capi.so` on `LD_LIBRARY_PATH`, the UCX plugin under
/// `NIXL_PLUGIN_DIR`); without it [`NixlTransport::new`] fails with [`TransportError::Backend`].
pub struct NixlTransport {
    shared: Arc<Shared>,
    name: String,
}

impl std::fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransport")
            .field("agent", &self.name)
            .field("base", &format_args!("{:#x}", self.shared.base))
            .field("len", &self.shared.len)
            .finish_non_exhaustive()
    }
}

/// `e` as a [`TransportError::Backend`] naming `what` failed.
fn backend(what: &str, e: NixlError) -> TransportError {
    TransportError::Backend(format!("NIXL {what}: {e}"))
}

impl NixlTransport {
    /// True when nixl-sys loaded the NIXL runtime (`libnixl_capi.so`); without it every NIXL
    /// call would abort the process, so [`NixlTransport::new`] checks this first.
    pub fn runtime_available() -> bool {
        !nixl_sys::is_stub()
    }

    /// A NIXL agent named `name` (unique among the peers that will load its descriptor) with the
    /// UCX backend, and `pool`'s whole mapping ([`HostPool::mapped_bytes`] bytes from its base)
    /// registered as DRAM. The registration ends when the transport or the pool drops, whichever
    /// comes first.
    ///
    /// # Errors
    /// [`TransportError::Backend`]: the NIXL runtime was not found ([`Self::runtime_available`]),
    /// `name` holds a NUL byte, NIXL has no UCX plugin, or the agent, backend or registration
    /// failed.
    pub fn new(name: &str, pool: &HostPool) -> Result<Self, TransportError> {
        if !Self::runtime_available() {
            return Err(TransportError::Backend(RUNTIME_MISSING.to_string()));
        }
        if name.is_empty() || name.contains('\0') {
            return Err(TransportError::Backend(format!("agent name {name:?}: empty or holding a NUL byte")));
        }
        // Strict: NIXL serializes the agent's calls, so reads from several threads are safe. The
        // progress thread serves peers' reads of this pool (TCP) without a call from us.
        let config = AgentConfig { thread_sync: ThreadSync::Strict, enable_prog_thread: true, ..Default::default() };
        let agent = Agent::new_configured(name, &config).map_err(|e| backend("agent creation", e))?;
        let (_mems, params) = agent.get_plugin_params("UCX").map_err(|e| {
            TransportError::Backend(format!(
                "NIXL has no UCX plugin ({e}): set NIXL_PLUGIN_DIR to the folder holding libplugin_UCX.so"
            ))
        })?;
        let ucx = agent.create_backend("UCX", &params).map_err(|e| backend("UCX backend creation", e))?;
        let region = pool.region();
        let memory = PoolMemory { base: region.host_base, len: region.bytes as usize };
        let mut args = OptArgs::new().map_err(|e| backend("options", e))?;
        args.add_backend(&ucx).map_err(|e| backend("options", e))?;
        let registration =
            agent.register_memory(&memory, Some(&args)).map_err(|e| backend("registration of the host pool", e))?;
        let shared = Arc::new(Shared {
            agent,
            backend: ucx,
            base: region.host_base,
            len: region.bytes,
            registration: RwLock::new(Some(registration)),
            peers: RwLock::new(HashMap::new()),
            next_peer: AtomicU64::new(1),
            draining: Mutex::new(HashMap::new()),
            drained: Condvar::new(),
        });
        pool.with_registrations(|r| r.push(Box::new(PoolGuard(Arc::downgrade(&shared)))));
        Ok(NixlTransport { shared, name: name.to_string() })
    }

    /// This transport's NIXL agent name.
    pub fn agent_name(&self) -> &str {
        &self.name
    }

    /// Registered bytes of this instance's pool (reads' local ranges must lie below it).
    pub fn registered_bytes(&self) -> u64 {
        self.shared.len
    }

    /// The batch's range check: every read inside both pools. Zero-length reads are allowed
    /// (they move nothing).
    fn check_ranges(&self, peer: &Peer, reads: &[BlockRead]) -> Result<(), TransportError> {
        for (i, r) in reads.iter().enumerate() {
            let inside = |offset: u64, pool: u64| offset.checked_add(r.len).is_some_and(|end| end <= pool);
            if !inside(r.remote_offset, peer.len) {
                return Err(TransportError::OutOfRange(format!(
                    "read {i}: remote bytes {}..{} (+{} B) lie outside peer {}'s pool of {} B",
                    r.remote_offset,
                    r.remote_offset.saturating_add(r.len),
                    r.len,
                    peer.agent,
                    peer.len
                )));
            }
            if !inside(r.local_offset, self.shared.len) {
                return Err(TransportError::OutOfRange(format!(
                    "read {i}: local bytes {}..{} (+{} B) lie outside this pool of {} B",
                    r.local_offset,
                    r.local_offset.saturating_add(r.len),
                    r.len,
                    self.shared.len
                )));
            }
        }
        Ok(())
    }
}

impl Drop for NixlTransport {
    fn drop(&mut self) {
        // The agent lives on while the pool's guard holds `shared` upgraded; the registration
        // ends now either way.
        self.shared.deregister();
    }
}

/// Parses a descriptor: `(base, len, metadata)`.
fn parse_descriptor(d: &[u8]) -> Result<(u64, u64, &[u8]), TransportError> {
    let bad = |why: String| TransportError::Descriptor(why);
    if d.len() < HEADER_BYTES {
        return Err(bad(format!("{} B, shorter than the {HEADER_BYTES} B header", d.len())));
    }
    if d[0..4] != MAGIC {
        return Err(bad(format!("magic {:02x?}, not a kvtier NIXL descriptor ({MAGIC:02x?})", &d[0..4])));
    }
    let u16_at = |o: usize| u16::from_le_bytes([d[o], d[o + 1]]);
    let u64_at = |o: usize| u64::from_le_bytes(d[o..o + 8].try_into().expect("8 bytes"));
    let version = u16_at(4);
    if version != VERSION {
        return Err(bad(format!("version {version}; this build reads version {VERSION}")));
    }
    let (base, len) = (u64_at(8), u64_at(16));
    let md_len = u32::from_le_bytes(d[24..28].try_into().expect("4 bytes")) as usize;
    if d.len() - HEADER_BYTES != md_len {
        return Err(bad(format!("metadata of {md_len} B announced, {} B follow the header", d.len() - HEADER_BYTES)));
    }
    if md_len == 0 || len == 0 || base.checked_add(len).is_none() {
        return Err(bad(format!("empty metadata or pool ({md_len} B, {len} B at {base:#x})")));
    }
    Ok((base, len, &d[HEADER_BYTES..]))
}

impl PeerTransport for NixlTransport {
    /// The descriptor of the module docs: this pool's base and registered length, then the
    /// agent's NIXL metadata.
    ///
    /// # Errors
    /// [`TransportError::Backend`] if NIXL cannot produce its metadata or the pool was dropped.
    fn local_descriptor(&self) -> Result<Vec<u8>, TransportError> {
        if self.shared.registration.read().unwrap_or_else(|e| e.into_inner()).is_none() {
            return Err(TransportError::Backend("the host pool was dropped".into()));
        }
        let md = self.shared.agent.get_local_md().map_err(|e| backend("local metadata", e))?;
        let md_len = u32::try_from(md.len())
            .map_err(|_| TransportError::Backend(format!("NIXL metadata of {} B exceeds u32", md.len())))?;
        let mut d = Vec::with_capacity(HEADER_BYTES + md.len());
        d.extend_from_slice(&MAGIC);
        d.extend_from_slice(&VERSION.to_le_bytes());
        d.extend_from_slice(&0u16.to_le_bytes());
        d.extend_from_slice(&(self.shared.base as u64).to_le_bytes());
        d.extend_from_slice(&self.shared.len.to_le_bytes());
        d.extend_from_slice(&md_len.to_le_bytes());
        d.extend_from_slice(&md);
        Ok(d)
    }

    /// Loads the peer's NIXL metadata.
    ///
    /// # Errors
    /// [`TransportError::Descriptor`]: the bytes do not parse (module docs), NIXL cannot load the
    /// metadata, or it names this transport's own agent.
    fn add_peer(&self, descriptor: &[u8]) -> Result<TransportPeer, TransportError> {
        let (base, len, md) = parse_descriptor(descriptor)?;
        let mut peers = self.shared.peers.write().unwrap_or_else(|e| e.into_inner());
        let agent = self
            .shared
            .agent
            .load_remote_md(md)
            .map_err(|e| TransportError::Descriptor(format!("NIXL could not load the peer's metadata: {e}")))?;
        if agent == self.name {
            return Err(TransportError::Descriptor(format!(
                "the descriptor names this transport's own agent {agent:?}"
            )));
        }
        let id = self.shared.next_peer.fetch_add(1, Ordering::Relaxed);
        peers.insert(id, Peer { agent, base, len });
        Ok(TransportPeer(id))
    }

    /// Forgets `peer`; its NIXL metadata is invalidated once no other loaded peer names the same
    /// agent. Waits for reads in flight. An unknown peer is ignored.
    fn remove_peer(&self, peer: TransportPeer) {
        let mut peers = self.shared.peers.write().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = peers.remove(&peer.0) {
            if !peers.values().any(|q| q.agent == p.agent) {
                // Its metadata goes only once no transfer to it is draining.
                self.shared.wait_drained(Some(&p.agent));
                // NOT_FOUND (already gone) is the goal state; anything else leaves stale metadata
                // that no TransportPeer can reach.
                let _ = self.shared.agent.invalidate_remote_md(&p.agent);
            }
        }
    }

    /// One NIXL READ of the whole batch (see [`PeerTransport::read`]).
    ///
    /// # Errors
    /// [`TransportError::OutOfRange`] before anything is posted; [`TransportError::Deadline`] when
    /// `deadline` passes first (also when it has passed on entry: nothing is posted);
    /// [`TransportError::Disconnected`] when NIXL failed the posted transfer;
    /// [`TransportError::Backend`] when NIXL refused the request, `peer` is not loaded, or the
    /// pool was dropped.
    fn read_tracked(
        &self,
        peer: TransportPeer,
        reads: &[BlockRead],
        deadline: Instant,
        done: ReadDone,
    ) -> Result<(), TransportError> {
        let registration = self.shared.registration.read().unwrap_or_else(|e| e.into_inner());
        if registration.is_none() {
            return Err(TransportError::Backend("the host pool was dropped".into()));
        }
        let peers = self.shared.peers.read().unwrap_or_else(|e| e.into_inner());
        let p = peers.get(&peer.0).ok_or_else(|| {
            TransportError::Backend(format!("peer {} is not loaded (never added, or removed)", peer.0))
        })?;
        if !crate::seeded::seeded("nixl-read-skips-range-check") {
            self.check_ranges(p, reads)?;
        }
        let reads: Vec<&BlockRead> = reads.iter().filter(|r| r.len > 0).collect();
        if reads.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(TransportError::Deadline);
        }
        let mut local = XferDescList::new(MemType::Dram).map_err(|e| backend("descriptor list", e))?;
        let mut remote = XferDescList::new(MemType::Dram).map_err(|e| backend("descriptor list", e))?;
        for r in &reads {
            // In range (checked above), so neither sum overflows and both fit the address space.
            local.add_desc(self.shared.base.wrapping_add(r.local_offset as usize), r.len as usize, 0);
            remote.add_desc(p.base.wrapping_add(r.remote_offset) as usize, r.len as usize, 0);
        }
        let mut args = OptArgs::new().map_err(|e| backend("options", e))?;
        args.add_backend(&self.shared.backend).map_err(|e| backend("options", e))?;
        let agent = &self.shared.agent;
        let request = agent
            .create_xfer_req(XferOp::Read, &local, &remote, &p.agent, Some(&args))
            .map_err(|e| backend("READ request", e))?;
        match agent.post_xfer_req(&request, None) {
            Ok(false) => return Ok(()),
            Ok(true) => {}
            Err(NixlError::BackendError) => return Err(TransportError::Disconnected),
            Err(e) => return Err(backend("post of the READ", e)),
        }
        loop {
            match agent.get_xfer_status(&request) {
                Ok(XferStatus::Success) => return Ok(()),
                Ok(XferStatus::InProgress) if Instant::now() >= deadline => {
                    // Not released here: a release asks UCX to cancel, which is not synchronous.
                    // The drain releases it once NIXL says it is over, then drops `done`.
                    drain(&self.shared, request, p.agent.clone(), done);
                    return Err(TransportError::Deadline);
                }
                Ok(XferStatus::InProgress) => std::thread::yield_now(),
                Err(NixlError::NotFound) => {
                    // NIXL deleted the request itself (its peer's metadata was invalidated under
                    // it); releasing it again would free it twice. Unreachable while `peers` is
                    // held, kept for safety.
                    std::mem::forget(request);
                    return Err(TransportError::Disconnected);
                }
                Err(NixlError::BackendError) => return Err(TransportError::Disconnected),
                Err(e) => return Err(backend("status of the READ", e)),
            }
        }
    }
}

/// Polls `request` (a READ past its deadline) on a thread of its own until NIXL reports it over,
/// then releases it and drops `done` (module docs). Counted in `shared.draining` meanwhile.
fn drain(shared: &Arc<Shared>, request: nixl_sys::XferRequest, agent: String, done: ReadDone) {
    *shared.draining.lock().unwrap_or_else(|e| e.into_inner()).entry(agent.clone()).or_insert(0) += 1;
    // Shared with the thread, so that a thread that cannot start hands them back.
    let held = Arc::new(Mutex::new(Some((request, done))));
    let (s, h, name) = (shared.clone(), held.clone(), agent.clone());
    let job = move || {
        let Some((request, done)) = h.lock().unwrap_or_else(|e| e.into_inner()).take() else { return };
        let until = Instant::now() + DRAIN_LIMIT;
        let over = loop {
            match s.agent.get_xfer_status(&request) {
                Ok(XferStatus::InProgress) if Instant::now() < until => std::thread::sleep(Duration::from_millis(1)),
                Ok(XferStatus::InProgress) => break false,
                Err(NixlError::NotFound) => {
                    // NIXL deleted the request itself (with its transfers): releasing it again
                    // would free it twice.
                    std::mem::forget(request);
                    break true;
                }
                Ok(XferStatus::Success) | Err(_) => {
                    drop(request);
                    break true;
                }
            }
        };
        if over {
            drop(done);
        } else {
            // Never reported over: the slots stay withheld for good.
            tracing::warn!(agent = %name, "a NIXL READ past its deadline never ended: its slots stay quarantined");
            std::mem::forget(done);
        }
        drained_one(&s, &name);
    };
    if let Err(e) = std::thread::Builder::new().name("kvtier-nixl-drain".into()).spawn(job) {
        // No thread to wait on the transfer: release the request and keep the slots withheld
        // for good (`done` never dropped).
        tracing::error!(error = %e, "no drain thread for a NIXL READ past its deadline: its slots stay quarantined");
        if let Some((request, done)) = held.lock().unwrap_or_else(|e| e.into_inner()).take() {
            std::mem::forget(done);
            drop(request);
        }
        drained_one(shared, &agent);
    }
}

/// One drain of a transfer to `agent` ended.
fn drained_one(shared: &Shared, agent: &str) {
    let mut d = shared.draining.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = d.get_mut(agent) {
        *n -= 1;
        if *n == 0 {
            d.remove(agent);
        }
    }
    drop(d);
    shared.drained.notify_all();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor(base: u64, len: u64, md: &[u8]) -> Vec<u8> {
        let mut d = MAGIC.to_vec();
        d.extend_from_slice(&VERSION.to_le_bytes());
        d.extend_from_slice(&0u16.to_le_bytes());
        d.extend_from_slice(&base.to_le_bytes());
        d.extend_from_slice(&len.to_le_bytes());
        d.extend_from_slice(&(md.len() as u32).to_le_bytes());
        d.extend_from_slice(md);
        d
    }

    #[test]
    fn a_descriptor_parses_back_and_a_damaged_one_is_refused() {
        let d = descriptor(0x7f00_0000_0000, 1 << 20, b"metadata");
        assert_eq!(parse_descriptor(&d).unwrap(), (0x7f00_0000_0000, 1 << 20, &b"metadata"[..]));
        let short = &d[..HEADER_BYTES - 1];
        assert!(matches!(parse_descriptor(short), Err(TransportError::Descriptor(m)) if m.contains("shorter")));
        let mut magic = d.clone();
        magic[0] = b'X';
        assert!(matches!(parse_descriptor(&magic), Err(TransportError::Descriptor(m)) if m.contains("magic")));
        let mut version = d.clone();
        version[4] = 2;
        assert!(matches!(parse_descriptor(&version), Err(TransportError::Descriptor(m)) if m.contains("version 2")));
        let mut trailing = d.clone();
        trailing.push(0);
        assert!(matches!(parse_descriptor(&trailing), Err(TransportError::Descriptor(m)) if m.contains("follow")));
        let wraps = descriptor(u64::MAX - 10, 100, b"m");
        assert!(matches!(parse_descriptor(&wraps), Err(TransportError::Descriptor(_))));
    }
}

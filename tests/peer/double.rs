//! A test-only transport double: copies whole blocks between in-process pools. Each pool is
//! registered in a shared map (the "fabric") under an id; the id's bytes are its descriptor.
//! A hook, run at the start of a read (between the owner's pin and the bytes), lets tests change
//! the owner's state at that exact point; a late read ([`CopyTransport::late_next_read`]) returns
//! at its deadline while its bytes land later, as a transfer whose cancel is not synchronous.

use kvtier::{BlockRead, HostTier, PeerTransport, ReadDone, TransportError, TransportPeer};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The test's handles on a late read: send on `release` to let its bytes land; `landed` receives
/// once they have and the transport said the transfer is over.
pub struct Late {
    pub release: mpsc::Sender<()>,
    pub landed: mpsc::Receiver<()>,
}

type Hook = Box<dyn FnOnce() + Send>;

/// The pools reachable by the doubles: id -> (base address, bytes).
#[derive(Default)]
pub struct Fabric {
    pools: Mutex<HashMap<u64, (usize, u64)>>,
    next: AtomicU64,
}

impl Fabric {
    pub fn new() -> Arc<Fabric> {
        Arc::new(Fabric::default())
    }

    /// A transport over `tier`'s pool, registered in the fabric.
    pub fn transport(self: &Arc<Fabric>, tier: &HostTier) -> Arc<CopyTransport> {
        let r = tier.pool().region();
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.pools.lock().unwrap().insert(id, (r.host_base, r.bytes));
        Arc::new(CopyTransport {
            fabric: self.clone(),
            id,
            hook: Mutex::new(None),
            late: Mutex::new(None),
            reads: AtomicU64::new(0),
        })
    }

    /// Takes pool `id` off the fabric (its instance went away): reads from it fail `Disconnected`.
    pub fn unregister(&self, id: u64) {
        self.pools.lock().unwrap().remove(&id);
    }
}

pub struct CopyTransport {
    fabric: Arc<Fabric>,
    pub id: u64,
    hook: Mutex<Option<Hook>>,
    late: Mutex<Option<(mpsc::Receiver<()>, mpsc::Sender<()>)>>,
    /// Read batches performed.
    pub reads: AtomicU64,
}

impl CopyTransport {
    /// Runs `hook` at the start of the next read (once).
    pub fn on_next_read(&self, hook: impl FnOnce() + Send + 'static) {
        *self.hook.lock().unwrap() = Some(Box::new(hook));
    }

    /// Makes the next read late: it returns `Deadline` at its deadline, and its bytes land only
    /// when the test sends on [`Late::release`] (then the transfer is over).
    pub fn late_next_read(&self) -> Late {
        let (release, wait) = mpsc::channel();
        let (tell, landed) = mpsc::channel();
        *self.late.lock().unwrap() = Some((wait, tell));
        Late { release, landed }
    }
}

/// Copies `reads` from pool `rbase` into pool `lbase` (ranges checked by the caller).
fn copy(rbase: usize, lbase: usize, reads: &[BlockRead]) {
    for r in reads {
        // SAFETY: both ranges lie inside registered pool mappings (checked by the caller), which
        // the tests keep alive while a read runs; the pools are distinct mappings, so the ranges
        // do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (rbase + r.remote_offset as usize) as *const u8,
                (lbase + r.local_offset as usize) as *mut u8,
                r.len as usize,
            )
        };
    }
}

impl PeerTransport for CopyTransport {
    fn local_descriptor(&self) -> Result<Vec<u8>, TransportError> {
        Ok(self.id.to_le_bytes().to_vec())
    }

    fn add_peer(&self, descriptor: &[u8]) -> Result<TransportPeer, TransportError> {
        let id =
            u64::from_le_bytes(descriptor.try_into().map_err(|_| TransportError::Descriptor("not 8 bytes".into()))?);
        if !self.fabric.pools.lock().unwrap().contains_key(&id) {
            return Err(TransportError::Descriptor(format!("no pool {id}")));
        }
        Ok(TransportPeer(id))
    }

    fn remove_peer(&self, _peer: TransportPeer) {}

    fn read_tracked(
        &self,
        peer: TransportPeer,
        reads: &[BlockRead],
        deadline: Instant,
        done: ReadDone,
    ) -> Result<(), TransportError> {
        let hook = self.hook.lock().unwrap().take();
        if let Some(h) = hook {
            h();
        }
        self.reads.fetch_add(1, Ordering::Relaxed);
        if Instant::now() >= deadline {
            return Err(TransportError::Deadline);
        }
        let pools = self.fabric.pools.lock().unwrap();
        let &(rbase, rlen) = pools.get(&peer.0).ok_or(TransportError::Disconnected)?;
        let &(lbase, llen) = pools.get(&self.id).ok_or(TransportError::Disconnected)?;
        for r in reads {
            if r.remote_offset.checked_add(r.len).is_none_or(|e| e > rlen) {
                return Err(TransportError::OutOfRange(format!("remote {}+{}", r.remote_offset, r.len)));
            }
            if r.local_offset.checked_add(r.len).is_none_or(|e| e > llen) {
                return Err(TransportError::OutOfRange(format!("local {}+{}", r.local_offset, r.len)));
            }
        }
        let late = self.late.lock().unwrap().take();
        if let Some((wait, tell)) = late {
            drop(pools);
            // The transfer goes on after the deadline: its bytes land when the test says, then it
            // is over.
            let reads = reads.to_vec();
            std::thread::spawn(move || {
                let _ = wait.recv();
                copy(rbase, lbase, &reads);
                drop(done);
                let _ = tell.send(());
            });
            std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
            return Err(TransportError::Deadline);
        }
        copy(rbase, lbase, reads);
        drop(pools);
        drop(done);
        Ok(())
    }
}

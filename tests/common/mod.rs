//! Shared helpers for integration tests: a small geometry, tiers over the host backend, and copy
//! backends that hold completions behind a gate or fail on demand.
#![allow(dead_code)]

use kvtier::{
    ArenaSpec, Completion, ContentKey, CopyBackend, CopyError, CopyPair, EngineArenas, Geometry, HostPool, HostTier,
    PolicyKind, TierConfig, WaitFor,
};
use kvtier::{MemcpyArenas, MemcpyBackend};
use std::sync::{Arc, Condvar, Mutex};

/// Two arenas (4,096 B and 1,024 B per page), 64 pages: 5,120 B slots.
pub fn small_geometry() -> Geometry {
    Geometry::new("test-model", 16, vec![ArenaSpec::packed("big", 4096, 64), ArenaSpec::packed("small", 1024, 64)])
        .unwrap()
}

/// A tier of `slots` slots over `small_geometry`, with `policy`.
pub fn tier(slots: u64, policy: PolicyKind) -> HostTier {
    HostTier::new(tier_config(slots, policy)).unwrap()
}

/// The configuration of [`tier`], to adjust before building.
pub fn tier_config(slots: u64, policy: PolicyKind) -> TierConfig {
    let g = small_geometry();
    TierConfig::new(g.clone(), slots * g.slot_bytes()).with_policy(policy).with_backing(kvtier::BackingChoice::Plain)
}

/// Fresh host arenas for `small_geometry`.
pub fn arenas() -> Arc<MemcpyArenas> {
    Arc::new(MemcpyArenas::new(&small_geometry()).unwrap())
}

/// Keys 0..n in the tier's namespace.
pub fn keys(tier: &HostTier, range: std::ops::Range<u64>) -> Vec<ContentKey> {
    range.map(|i| tier.namespace().trace_page_key(i, 0)).collect()
}

/// Sets the flag when dropped: a test's background threads, which loop until it is set, stop
/// however the test's own thread leaves (a failed assertion included), so a scope joining them
/// ends instead of waiting forever.
pub struct StopOnDrop<'a>(pub &'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }
}

/// A gate that holds completions until opened.
#[derive(Clone, Default)]
pub struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    pub fn open(&self) {
        *self.0 .0.lock().unwrap() = true;
        self.0 .1.notify_all();
    }
    fn wait(&self) {
        let mut g = self.0 .0.lock().unwrap();
        while !*g {
            g = self.0 .1.wait(g).unwrap();
        }
    }
}

/// A host backend whose copies complete only after `gate` opens, or fail if `fail` is set.
pub struct TestBackend {
    pub inner: MemcpyBackend,
    pub gate: Option<Gate>,
    pub fail: bool,
    /// `Completion::wait` panics (a buggy backend) instead of returning.
    pub panic: bool,
}

impl TestBackend {
    pub fn gated(arenas: &Arc<MemcpyArenas>, gate: &Gate) -> Box<dyn CopyBackend> {
        Box::new(TestBackend {
            inner: MemcpyBackend::new(arenas.clone()),
            gate: Some(gate.clone()),
            fail: false,
            panic: false,
        })
    }
    pub fn failing(arenas: &Arc<MemcpyArenas>) -> Box<dyn CopyBackend> {
        Box::new(TestBackend { inner: MemcpyBackend::new(arenas.clone()), gate: None, fail: true, panic: false })
    }
    /// Copies that complete after `gate` opens, by panicking in `Completion::wait`.
    pub fn panicking(arenas: &Arc<MemcpyArenas>, gate: &Gate) -> Box<dyn CopyBackend> {
        Box::new(TestBackend {
            inner: MemcpyBackend::new(arenas.clone()),
            gate: Some(gate.clone()),
            fail: false,
            panic: true,
        })
    }
}

struct TestCompletion {
    inner: Box<dyn Completion>,
    gate: Option<Gate>,
    fail: bool,
    panic: bool,
}

impl Completion for TestCompletion {
    fn poll(&mut self) -> Result<bool, CopyError> {
        unimplemented!("the tier waits")
    }
    fn wait(&mut self) -> Result<(), CopyError> {
        if let Some(g) = &self.gate {
            g.wait();
        }
        if self.panic {
            panic!("test backend: Completion::wait panicked");
        }
        if self.fail {
            return Err(CopyError::Injected { call: "test" });
        }
        self.inner.wait()
    }
}

impl CopyBackend for TestBackend {
    fn name(&self) -> &'static str {
        "test"
    }
    fn geometry(&self) -> &Geometry {
        self.inner.geometry()
    }
    fn bind_pool(&mut self, pool: &HostPool) -> Result<(), CopyError> {
        self.inner.bind_pool(pool)
    }
    unsafe fn save(&self, b: &[CopyPair], w: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        // SAFETY: forwarded under the caller's contract.
        let inner = unsafe { self.inner.save(b, w) }?;
        Ok(Box::new(TestCompletion { inner, gate: self.gate.clone(), fail: self.fail, panic: self.panic }))
    }
    unsafe fn restore(&self, b: &[CopyPair], w: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        // SAFETY: forwarded under the caller's contract.
        let inner = unsafe { self.inner.restore(b, w) }?;
        Ok(Box::new(TestCompletion { inner, gate: self.gate.clone(), fail: self.fail, panic: self.panic }))
    }
}

/// Fills pages with keys' bytes and saves them, waiting for completion.
pub fn save_filled(
    rank: &kvtier::Rank,
    a: &Arc<MemcpyArenas>,
    keys: &[ContentKey],
    pages: &[u64],
) -> kvtier::SaveTicket {
    a.fill(pages, keys).unwrap();
    let t = rank.save(keys, pages, WaitFor::Nothing).unwrap();
    t.handle.wait().unwrap();
    t
}

//! [`NullBackend`]: a copy backend that moves no bytes. Every batch is complete at once.
//!
//! For measuring the tier's own work without copies (`kvtier simulate`, the CPU benchmarks) and
//! for a tier whose blocks are only bookkeeping. A restore through it leaves the GPU pages as they
//! were, so it must never serve an engine's real KV cache.

use super::{Completion, CopyBackend, CopyPair, Done, WaitFor};
use crate::error::CopyError;
use crate::geometry::Geometry;
use crate::slab::pool::HostPool;

/// A copy backend that moves nothing (see the module docs).
#[derive(Debug, Clone)]
pub struct NullBackend {
    geometry: Geometry,
}

impl NullBackend {
    /// A backend for `geometry` (attach it to a tier of the same geometry).
    pub fn new(geometry: Geometry) -> Self {
        NullBackend { geometry }
    }
}

impl CopyBackend for NullBackend {
    fn name(&self) -> &'static str {
        "null"
    }
    fn geometry(&self) -> &Geometry {
        &self.geometry
    }
    fn bind_pool(&mut self, pool: &HostPool) -> Result<(), CopyError> {
        if pool.slot_bytes() != self.geometry.slot_bytes() {
            return Err(CopyError::SlotSizeMismatch { pool: pool.slot_bytes(), geometry: self.geometry.slot_bytes() });
        }
        Ok(())
    }
    unsafe fn save(&self, _batch: &[CopyPair], _wait: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        Ok(Box::new(Done(Ok(()))))
    }
    unsafe fn restore(&self, _batch: &[CopyPair], _wait: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        Ok(Box::new(Done(Ok(()))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::ArenaSpec;
    use crate::slab::pool::HostPool;
    use crate::slab::pool::{BackingChoice, PoolConfig};

    fn geometry(pages: u64) -> Geometry {
        Geometry::new("null-test", 64, vec![ArenaSpec::packed("kv", 16, pages)]).expect("a valid geometry")
    }

    #[test]
    fn binds_a_pool_of_its_slot_size_only_and_completes_at_once() {
        let g = geometry(4);
        let mut b = NullBackend::new(g.clone());
        let pool =
            HostPool::new(g.slot_bytes(), &PoolConfig::new(2 * g.slot_bytes()).with_backing(BackingChoice::Plain))
                .expect("a pool");
        b.bind_pool(&pool).expect("same slot size binds");
        let other =
            HostPool::new(2 * g.slot_bytes(), &PoolConfig::new(4 * g.slot_bytes()).with_backing(BackingChoice::Plain))
                .expect("a pool");
        assert!(matches!(b.bind_pool(&other), Err(CopyError::SlotSizeMismatch { .. })));
        // SAFETY: the null backend dereferences nothing.
        let mut c = unsafe { b.save(&[], WaitFor::Nothing) }.expect("a save");
        assert!(c.poll().expect("no error"));
        c.wait().expect("no error");
    }
}

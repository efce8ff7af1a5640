//! The slab: the host pool's memory and the state of its slots.
//!
//! - `pool.rs`: the mapping ([`HostPool`]: hugetlb, transparent huge pages or plain pages, the
//!   slots' bytes), with `pool/shared.rs` the pool in a memfd other processes map;
//! - `slot.rs`: each slot's control word (state, pins, generation) and its transitions;
//! - `freelist.rs`: the lock-free free list of slots (sharded Treiber stacks).

pub(crate) mod freelist;
pub(crate) mod pool;
pub(crate) mod slot;

pub use pool::{
    hugetlb_free_pages, Backing, BackingChoice, HostPool, PoolConfig, PoolRegion, SharedPoolLayout, HUGE_PAGE_BYTES,
    MAX_SLOTS, POOL_SEALS,
};
pub use slot::SlotId;

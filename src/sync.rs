//! The one place the crate names its synchronisation primitives.
//!
//! Every atomic, `Arc`, `Mutex` and spin hint used by the pool, the index, leases, guards and eviction
//! comes from here. A normal build re-exports `std`; a model-checking build (`--cfg loom`, see
//! `loom-tests/`) re-exports [loom](https://docs.rs/loom)'s instrumented versions, so the same code is
//! explored under every interleaving loom can reach. No other module names `std::sync::atomic`.

#[cfg(not(loom))]
mod imp {
    pub use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
    pub use std::sync::{Arc, Condvar, Mutex, MutexGuard};
    pub use std::thread;

    /// Spin-loop hint for CAS retry loops (loom yields to another thread here instead).
    #[inline]
    pub fn spin_loop() {
        std::hint::spin_loop();
    }
}

#[cfg(loom)]
mod imp {
    pub use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
    pub use loom::sync::{Arc, Condvar, Mutex, MutexGuard};
    pub use loom::thread;

    /// Spin-loop hint for CAS retry loops: under loom this yields so the model makes progress.
    #[inline]
    pub fn spin_loop() {
        loom::hint::spin_loop();
    }
}

pub use imp::*;

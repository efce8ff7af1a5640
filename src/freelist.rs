//! Lock-free free list of slot ids. (STUB: being written.)

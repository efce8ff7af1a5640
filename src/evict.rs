//! Eviction policies. (STUB)

//! Leases. (STUB)

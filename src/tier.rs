//! HostTier. (STUB)

//! Mooncake trace parsing. (STUB: being written.)

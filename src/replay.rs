//! Trace replay through the tier. (STUB: being written.)

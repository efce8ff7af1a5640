//! CUDA copy backend. (STUB: being written.)

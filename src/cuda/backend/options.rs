//! How a [`super::CudaBackend`] copies: [`CopyMode`] and the tuning options [`CudaOptions`].

/// How a batch crosses PCIe.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum CopyMode {
    /// The kernel reads/writes host slots directly through the pool's device alias.
    ZeroCopy,
    /// The kernel gathers into (scatters from) an HBM staging buffer and the copy engine moves it
    /// with one `cuMemcpyAsync` per run of consecutive host slots, pipelined in pieces over two
    /// halves of the buffer (the kernel of piece k+1 runs while the copy engine moves piece k).
    /// Pieces are cut at segment boundaries, also inside a block: a save's first piece (a
    /// restore's last) is [`CudaOptions::staged_first_piece_bytes`], and each next piece (each
    /// earlier one) twice the size, up to [`CudaOptions::staged_piece_blocks`] blocks, so the
    /// exposed kernel time at the start of a save (end of a restore) is one small piece. Holds SMs
    /// only for the short HBM kernels; needs `2 * (staged_piece_blocks + 2)` slots of HBM per
    /// direction.
    ///
    /// With a head ([`CudaOptions::save_head_bytes`], [`CudaOptions::restore_head_bytes`]) the
    /// batch's first bytes move zero copy on a second stream at the same time, so the link is busy
    /// from the first microsecond while the pipeline's first gather (or last scatter) runs.
    Staged,
    /// Zero copy for batches of fewer than [`CudaOptions::auto_staged_min_blocks`] blocks, staged
    /// (with its head) from there on. The default.
    #[default]
    Auto,
}

/// Tuning of a [`CudaBackend`](super::CudaBackend). Defaults chosen by measurement on an H200 (see `docs/benchmarks.md`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// CTAs (of 512 threads) of a save launch (zero copy, also a staged save's head). Default 2.
    pub save_ctas: u32,
    /// CTAs of a restore launch (zero copy, also a staged restore's head). Default 4.
    pub restore_ctas: u32,
    /// 16-byte loads in flight per lane in saves: 4 or 8. Default 4.
    pub save_unroll: u32,
    /// 16-byte loads in flight per lane in restores: 4 or 8. Default 8.
    pub restore_unroll: u32,
    /// Zero copy, staged, or by batch size.
    pub mode: CopyMode,
    /// Staged mode: largest piece of the pipeline, in blocks. Default 8 (2 x 10 slots = 69 MB of
    /// HBM per direction for GLM-5.2).
    pub staged_piece_blocks: u32,
    /// Staged mode: bytes of a save's first piece and a restore's last piece (rounded up to a
    /// segment boundary); the pieces double from there. At least 1. Default 512 KiB.
    pub staged_first_piece_bytes: u64,
    /// Staged mode: bytes at the start of a save batch (rounded up to a segment boundary) that move
    /// zero copy, on a second stream, while the pipeline moves the rest. 0 = none. Default 0.
    pub save_head_bytes: u64,
    /// Staged mode: as [`CudaOptions::save_head_bytes`], for restores. Default 0.
    pub restore_head_bytes: u64,
    /// Auto mode: batches of at least this many blocks are staged. Default 2 (one block alone is
    /// faster zero copy: 72 us against 82 us staged on the H200).
    pub auto_staged_min_blocks: u32,
    /// Staged mode: CTAs of the HBM gather/scatter kernel. Default 8.
    pub staged_ctas: u32,
    /// Staged mode: 16-byte loads in flight per lane of the HBM kernel: 4 or 8. Default 8.
    pub staged_unroll: u32,
    /// Create the backend's streams with the device's greatest priority, so its kernels' CTAs are
    /// dispatched ahead of pending CTAs of the engine's default-priority streams. Default true
    /// (measured neutral on the H200 benchmark: see `docs/benchmarks.md`).
    pub high_priority: bool,
    /// SMs reserved for the copy kernels: when non-zero, every kernel of the backend runs in a
    /// CUDA green context holding at least this many SMs (rounded up to the device's partition
    /// granularity, 8 on an H200), and [`CudaBackend::sm_partition`](super::CudaBackend::sm_partition) gives the engine streams on
    /// the other SMs. Isolation holds only for engine kernels launched on those streams. Where
    /// green contexts are unavailable (a driver older than CUDA 12.4, too many SMs asked) the
    /// backend runs as with 0 and [`CudaBackend::isolation`](super::CudaBackend::isolation) says why. Default 0.
    pub reserved_sms: u32,
    /// Queue the copy-engine copies of a staged piece (one per run of consecutive host slots) and
    /// the one-dimensional copies of a layer-wise group's piece (a group that is part of a slot
    /// moves each run of several consecutive slots with one `cuMemcpy2DAsync`, as before) with one
    /// `cuMemcpyBatchAsync` call where the driver has it (CUDA 13 and later) instead of one
    /// `cuMemcpyAsync` each: the same copies, less CPU time in the
    /// `save` / `restore` call (each single call costs 2-3 us; a batch of 128 scattered blocks
    /// makes about 128: on an H100 such a GLM-5.2 restore call took 230 us batched, 397 us not,
    /// `docs/benchmarks.md`). False, or an older driver: one call per copy. Default true.
    pub batched_copies: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            save_ctas: 2,
            restore_ctas: 4,
            save_unroll: 4,
            restore_unroll: 8,
            mode: CopyMode::Auto,
            staged_piece_blocks: 8,
            staged_first_piece_bytes: 512 << 10,
            save_head_bytes: 0,
            restore_head_bytes: 0,
            auto_staged_min_blocks: 2,
            staged_ctas: 8,
            staged_unroll: 8,
            high_priority: true,
            reserved_sms: 0,
            batched_copies: true,
        }
    }
}

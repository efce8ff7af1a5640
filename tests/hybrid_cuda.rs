//! GPU byte parity of every hybrid preset (`HybridLayout::PRESETS`): one `CudaArenas` per cache
//! group, a `HybridTier` over them, a prefix saved the way an engine would (every full-attention
//! block, the sliding window's blocks before the prefix's end, the one state checkpoint at the
//! end), queried, restored into other GPU pages and verified there; then prefixes whose window
//! block or state checkpoint is missing, which answer a shorter boundary or a miss, the shorter
//! one restored and verified too. Every test needs an NVIDIA GPU: `cargo test --features cuda
//! --test hybrid_cuda -- --include-ignored`. GPU arenas per test: at most 2.5 GB (Qwen3-Next's
//! 32 state pages of 77.9 MB), plus the staged path's buffers (20 slots per
//! direction of a group that moves 2 blocks or more: 0.3 GB for Gemma-3's sliding group); host
//! pools at most 1.7 GB (Gemma-3's).
#![cfg(feature = "cuda")]

use std::ops::Range;
use std::sync::Arc;

use kvtier::{
    ContentKey, CudaArenas, CudaOptions, EngineArenas, GroupKind, GroupPages, HybridConfig, HybridLayout, HybridRank,
    HybridTier, TierConfig, WaitFor,
};

/// Sizes of one preset's case: the prefix saved (in blocks), the shorter boundary the "missing"
/// case saves the window or checkpoint for, and the GPU pages per arena.
#[derive(Clone, Copy, Debug)]
struct Case {
    prefix: usize,
    shorter: usize,
    pages: u64,
}

/// The case of preset `name`. The pages are twice the prefix, so every restore lands in pages
/// `prefix..` while the saved blocks came from pages `0..`.
fn case(name: &str) -> Case {
    match name {
        // 1,280 tokens: the 1,024-token window is 64 blocks of 6.8 MB (160 pages: 1.09 GB for the
        // sliding group, 210 MB for the full one). The shorter boundary (72) has its own window.
        "gemma3-27b" => Case { prefix: 80, shorter: 72, pages: 160 },
        // 256 tokens: a state checkpoint is 77.9 MB, so few pages (32: 2.49 GB of state arenas).
        "qwen3-next-80b" => Case { prefix: 16, shorter: 8, pages: 32 },
        // 1,280 tokens: 9.2 MB checkpoints (160 pages: 1.47 GB of state arenas).
        "jamba-v0.1" => Case { prefix: 80, shorter: 40, pages: 160 },
        other => panic!("no GPU case for preset `{other}`: add one to tests/hybrid_cuda.rs"),
    }
}

/// One preset on the GPU: its layout, a tier whose group pools hold every block the case saves,
/// one `CudaArenas` per group and the rank over them.
struct Gpu {
    // The rank first: it shuts down (its copies finished) before the tier and arenas drop.
    rank: HybridRank,
    tier: HybridTier,
    arenas: Vec<Arc<CudaArenas>>,
    layout: HybridLayout,
    case: Case,
}

impl Gpu {
    fn new(name: &str) -> Gpu {
        let case = case(name);
        let layout = HybridLayout::preset(name, case.pages).unwrap();
        // Blocks each group's pool receives over the three prefixes of `parity` (full: three
        // prefixes; window: two windows and one short of a block; state: two checkpoints), and
        // some slack so no save has to evict.
        let mut config = HybridConfig::new(layout.clone(), 0);
        for (g, t) in config.tiers.iter_mut().enumerate() {
            let geometry = layout.groups()[g].geometry.clone();
            let blocks = match layout.groups()[g].kind {
                GroupKind::Full => 3 * case.prefix,
                GroupKind::SlidingWindow { .. } => 3 * layout.needed(g, case.prefix).len(),
                GroupKind::State => 2,
            } as u64
                + 4;
            *t = TierConfig::new(geometry.clone(), blocks * geometry.slot_bytes());
        }
        let tier = HybridTier::new(config).unwrap();
        let arenas: Vec<Arc<CudaArenas>> =
            layout.groups().iter().map(|g| CudaArenas::new(0, &g.geometry, CudaOptions::default()).unwrap()).collect();
        let rank = tier.attach(arenas.iter().map(|a| a.backend().unwrap()).collect()).unwrap();
        Gpu { rank, tier, arenas, layout, case }
    }

    fn groups(&self) -> usize {
        self.layout.groups().len()
    }

    fn kind(&self, g: usize) -> GroupKind {
        self.layout.groups()[g].kind
    }

    /// Content keys of a chain of `n` blocks whose tokens derive from `seed`.
    fn chain(&self, seed: u32, n: usize) -> Vec<ContentKey> {
        let t = self.layout.page_tokens() as usize;
        let mut keys: Vec<ContentKey> = Vec::with_capacity(n);
        for i in 0..n {
            let tokens: Vec<u32> = (0..t as u32).map(|j| seed.wrapping_mul(1_000_003) ^ (i as u32 * 64 + j)).collect();
            keys.push(self.layout.namespace().chain(keys.last(), &tokens));
        }
        keys
    }

    fn group_keys(&self, g: usize, keys: &[ContentKey], range: Range<usize>) -> Vec<ContentKey> {
        keys[range].iter().map(|k| self.layout.group_key(g, k)).collect()
    }

    /// "Prefill": writes group `g`'s blocks `ranges[g]` of `keys` into GPU pages `0..` of its
    /// arenas, then saves them all in one `HybridRank::save` and waits for it.
    fn save(&self, keys: &[ContentKey], ranges: &[Range<usize>]) {
        assert_eq!(ranges.len(), self.groups());
        let pages: Vec<GroupPages> = ranges
            .iter()
            .enumerate()
            .map(|(g, r)| {
                if r.is_empty() {
                    return GroupPages::none();
                }
                let p: Vec<u64> = (0..r.len() as u64).collect();
                self.arenas[g].fill(&p, &self.group_keys(g, keys, r.clone())).unwrap();
                GroupPages::new(r.start, p)
            })
            .collect();
        self.rank.save(keys, &pages, WaitFor::Nothing).unwrap().wait().unwrap();
    }

    /// Queries `keys`, checks the boundary is `want` and every group's range is what a restore
    /// there needs, restores every group into GPU pages from `prefix` (first overwritten with
    /// other bytes, so only the restore can make them right), verifies them on the GPU and checks
    /// the bytes the groups' tiers count as restored.
    fn restore_and_verify(&self, keys: &[ContentKey], want: usize) {
        let lease = self.tier.query(keys);
        assert_eq!(lease.boundary(), want, "{}: boundary", self.layout.model());
        assert_eq!(self.tier.usable_prefix(keys), want, "{}: usable_prefix", self.layout.model());
        if want == 0 {
            return;
        }
        let scrub = self.chain(0xdead, self.case.prefix);
        let first = self.case.prefix as u64;
        let mut dst = Vec::with_capacity(self.groups());
        for g in 0..self.groups() {
            let range = lease.range(g);
            assert_eq!(range, self.layout.needed(g, want), "{} group {g}: leased range", self.layout.model());
            let pages: Vec<u64> = (first..first + range.len() as u64).collect();
            self.arenas[g].fill(&pages, &self.group_keys(g, &scrub, 0..range.len())).unwrap();
            dst.push(pages);
        }
        let before: u64 = (0..self.groups()).map(|g| self.tier.group(g).stats().bytes_restored).sum();
        let restore = self.rank.restore(&lease, &dst, WaitFor::Nothing).unwrap();
        restore.wait().unwrap();
        for (g, pages) in dst.iter().enumerate() {
            let h = restore.handles[g].as_ref().expect("every group restores something");
            assert_eq!(h.blocks(), pages.len(), "group {g}: blocks restored");
            assert_eq!(h.bytes(), pages.len() as u64 * self.layout.groups()[g].geometry.slot_bytes());
            self.arenas[g]
                .verify(pages, &self.group_keys(g, keys, lease.range(g)))
                .unwrap_or_else(|e| panic!("{} group {g} at boundary {want}: {e}", self.layout.model()));
        }
        let after: u64 = (0..self.groups()).map(|g| self.tier.group(g).stats().bytes_restored).sum();
        assert_eq!(after - before, self.layout.restore_bytes(want), "{}: bytes restored", self.layout.model());
        drop(lease);
    }
}

/// The parity run of preset `name`:
/// 1. a whole prefix saved as an engine would (every full-attention block, the window before the
///    prefix's end, the checkpoint at the end): a hit at the prefix, every group's bytes restored;
/// 2. another prefix whose window or checkpoint is saved for a shorter boundary only (the end's
///    is missing): the query answers the shorter boundary, restored and verified there;
/// 3. a third whose window lacks its oldest block, or that has no checkpoint at all: a miss, its
///    full-attention blocks resident all the same.
fn parity(name: &str) {
    let gpu = Gpu::new(name);
    let Case { prefix: n, shorter: m, .. } = gpu.case;
    assert!(0 < m && m < n && n as u64 * 2 <= gpu.case.pages);
    let groups = gpu.groups();
    let attention = (0..groups).any(|g| matches!(gpu.kind(g), GroupKind::SlidingWindow { .. }));
    let state = (0..groups).any(|g| gpu.kind(g) == GroupKind::State);
    assert!(attention || state, "{name}: a hybrid preset has a window or a state group");

    // 1. Everything a restore at n needs.
    let keys = gpu.chain(1, n);
    let whole: Vec<Range<usize>> = (0..groups).map(|g| gpu.layout.needed(g, n)).collect();
    gpu.save(&keys, &whole);
    gpu.restore_and_verify(&keys, n);

    // 2. The window or checkpoint of boundary m only: every block of 0..n in the full groups.
    let keys = gpu.chain(2, n);
    let shorter: Vec<Range<usize>> = (0..groups)
        .map(|g| match gpu.kind(g) {
            GroupKind::Full => 0..n,
            _ => gpu.layout.needed(g, m),
        })
        .collect();
    gpu.save(&keys, &shorter);
    gpu.restore_and_verify(&keys, m);

    // 3. The end's window short of its oldest block, and no checkpoint: a miss (no boundary below
    // n has its window either: the saved blocks all lie in the last window).
    let keys = gpu.chain(3, n);
    let missing: Vec<Range<usize>> = (0..groups)
        .map(|g| match gpu.kind(g) {
            GroupKind::Full => 0..n,
            GroupKind::SlidingWindow { .. } => {
                let r = gpu.layout.needed(g, n);
                r.start + 1..r.end
            }
            GroupKind::State => 0..0,
        })
        .collect();
    gpu.save(&keys, &missing);
    for g in (0..groups).filter(|&g| gpu.kind(g) == GroupKind::Full) {
        let resident = keys.iter().filter(|k| gpu.tier.group(g).contains(&gpu.layout.group_key(g, k))).count();
        assert_eq!(resident, n, "{name} group {g}: the attention blocks are resident");
    }
    gpu.restore_and_verify(&keys, 0);

    // The first prefix is still whole: restored again, into the same pages.
    gpu.restore_and_verify(&gpu.chain(1, n), n);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn hybrid_gpu_cases_cover_every_preset() {
    for &name in HybridLayout::PRESETS {
        let c = case(name);
        let l = HybridLayout::preset(name, c.pages).unwrap();
        assert!(c.shorter < c.prefix && 2 * c.prefix as u64 <= c.pages, "{name}: {c:?}");
        let gpu_bytes: u64 = l.groups().iter().map(|g| g.geometry.slot_bytes() * c.pages).sum();
        assert!(gpu_bytes < 4_000_000_000, "{name}: {gpu_bytes} B of GPU arenas");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn hybrid_gpu_parity_gemma3_27b() {
    parity("gemma3-27b");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn hybrid_gpu_parity_qwen3_next_80b() {
    parity("qwen3-next-80b");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn hybrid_gpu_parity_jamba_v0_1() {
    parity("jamba-v0.1");
}

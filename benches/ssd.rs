//! The SSD tier under a host tier, through the public API: demotion (host slot to disk slot) and
//! promotion (a query reading disk blocks into host slots) of GLM-5.2 blocks (3,452,160 B, a
//! 3,452,928 B disk stride), 16 blocks a measurement, `O_DIRECT` where the filesystem takes it.
//!
//! - **`demote_16`**: 16 blocks saved earlier get their admitting use (a query; admission at 2
//!   uses); the time from the query to `HostTier::flush_demotions` returning: the demotion thread
//!   pins each host slot, copies it into its aligned staging buffer with its XXH3-64 and writes
//!   it, one `pwrite` at a time (queue depth 1).
//! - **`promote_16_qd8`**: 16 blocks on disk and not on the host; the time of the query that
//!   promotes them: host slots taken (free ones; the host pool has room), 16 verified reads at
//!   depth 8 (io_uring), the blocks published pinned for the lease.
//!
//! Untimed between measurements: saving fresh blocks, demoting them, evicting the host pool.
//! Files go in `KVTIER_DISK_BENCH_DIR` (default `target/disk-bench`): a 64-slot SSD file (221 MB),
//! a 32-slot host pool and 64 GPU pages of host arenas in memory (331 MB). `benches/ssd_vs_fio.sh`
//! runs this and `fio` at the same block size and depths on the same directory, one after the other.
//! GB = 10^9 B.
//!
//! `cargo bench -p kvtier --bench ssd`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvtier::{
    BackingChoice, ContentKey, EngineArenas, Geometry, HostTier, MemcpyArenas, SsdConfig, TierConfig, WaitFor,
};

const BATCH: usize = 16;
const HOST_SLOTS: u64 = 32;
const DISK_SLOTS: u64 = 64;

struct Setup {
    tier: HostTier,
    rank: kvtier::Rank,
    next: u64,
    path: PathBuf,
}

impl Setup {
    fn new() -> Self {
        let dir =
            PathBuf::from(std::env::var_os("KVTIER_DISK_BENCH_DIR").unwrap_or_else(|| "target/disk-bench".into()));
        std::fs::create_dir_all(&dir).expect("the bench directory");
        let path = dir.join("ssd-bench.kvtier");
        let _ = std::fs::remove_file(&path);
        let g = Geometry::preset("glm52", 64).expect("the glm52 preset");
        let ssd = SsdConfig::new(&path, 4096 + DISK_SLOTS * g.disk_slot_bytes()).with_read_depth(8);
        let tier = HostTier::new(
            TierConfig::new(g.clone(), HOST_SLOTS * g.slot_bytes()).with_backing(BackingChoice::Plain).with_ssd(ssd),
        )
        .expect("the tier");
        let arenas = Arc::new(MemcpyArenas::new(&g).expect("host arenas"));
        let pages: Vec<u64> = (0..64).collect();
        let keys: Vec<ContentKey> = (0..64).map(|i| tier.namespace().trace_page_key(u64::MAX - i, 0)).collect();
        arenas.fill(&pages, &keys).expect("page bytes");
        let rank = tier.attach(arenas.backend().expect("a backend")).expect("a rank");
        eprintln!("ssd bench: {}", path.display());
        Setup { tier, rank, next: 0, path }
    }

    /// Saves 16 fresh blocks (one use each) and returns their keys.
    fn save_fresh(&mut self) -> Vec<ContentKey> {
        let keys: Vec<ContentKey> =
            (0..BATCH as u64).map(|i| self.tier.namespace().trace_page_key(self.next, i)).collect();
        self.next += 1;
        let pages: Vec<u64> = (0..BATCH as u64).collect();
        let t = self.rank.save(&keys, &pages, WaitFor::Nothing).expect("a save");
        t.handle.wait().expect("the save's copy");
        assert_eq!(t.saving.len(), BATCH, "fresh keys are all saved");
        keys
    }
}

fn ssd(c: &mut Criterion) {
    let mut s = Setup::new();
    let slot_bytes = s.tier.geometry().slot_bytes();
    let mut group = c.benchmark_group("ssd_glm52");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(BATCH as u64 * slot_bytes));
    group.bench_function("demote_16", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let keys = s.save_fresh();
                let t0 = Instant::now();
                drop(s.tier.query(&keys)); // the admitting use: all 16 are queued
                s.tier.flush_demotions();
                spent += t0.elapsed();
            }
            spent
        })
    });
    group.bench_function("promote_16_qd8", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let keys = s.save_fresh();
                drop(s.tier.query(&keys));
                s.tier.flush_demotions();
                s.tier.evict(HOST_SLOTS as usize);
                let t0 = Instant::now();
                let lease = s.tier.query(&keys);
                spent += t0.elapsed();
                assert_eq!(lease.promoted(), BATCH, "every block comes back from the drive");
            }
            spent
        })
    });
    group.finish();
    let st = s.tier.ssd_stats().expect("an SSD tier");
    eprintln!(
        "ssd bench: {} demoted, {} promoted, {} promotion failures, {} direct and {} buffered transfers",
        st.demoted_blocks, st.promoted_blocks, st.promotion_failures, st.io_direct, st.io_buffered
    );
    let path = s.path.clone();
    drop(s);
    let _ = std::fs::remove_file(&path);
}

criterion_group!(benches, ssd);
criterion_main!(benches);

//! The SSD tier under a host tier, through the public API: demotion (host slot to disk slot) and
//! promotion (a query reading disk blocks into host slots) of GLM-5.2 blocks (3,452,160 B, a
//! 3,452,928 B disk stride), 64 blocks (221 MB) a measurement, back to back, `O_DIRECT` where the filesystem takes it.
//!
//! - **`demote_64`**: 64 blocks saved earlier get their admitting use (a query; admission at 2
//!   uses); the time from the query to `HostTier::flush_demotions` returning: the demotion thread
//!   pins each host slot, copies it into its aligned staging buffer with its XXH3-64 and writes
//!   it, one `pwrite` at a time (queue depth 1).
//! - **`promote_64_qd8`**: 64 blocks on disk and not on the host; the time of the query that
//!   promotes them: host slots taken (free ones; the host pool has room), 64 verified reads at
//!   depth 8 (io_uring), the blocks published pinned for the lease.
//!
//! - **`disk_slots/evict_and_publish_N`**: the disk slots' eviction alone (below).
//!
//! Untimed between measurements: saving fresh blocks, demoting them, evicting the host pool.
//! Files go in `KVTIER_DISK_BENCH_DIR` (default `target/disk-bench`): a 128-slot SSD file (442 MB),
//! a 128-slot host pool and 64 GPU pages of host arenas in memory (663 MB). A batch is long enough
//! (64 transfers, a quarter of a second or more) that a drive's short write cache or burst credit
//! does not carry it. `benches/ssd_vs_fio.sh`
//! runs this and `fio` at the same block size and depths on the same directory, one after the other.
//! GB = 10^9 B.
//!
//! `cargo bench -p kvtier --bench ssd`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvtier::internals::ssd::DiskSlots;
use kvtier::{
    BackingChoice, ContentKey, EngineArenas, Geometry, HostTier, MemcpyArenas, SsdConfig, TierConfig, WaitFor,
};

const BATCH: usize = 64;
const HOST_SLOTS: u64 = 128;
const DISK_SLOTS: u64 = 128;

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
        // Admission after 2 uses: the query that follows the saves is the admitting use measured.
        let ssd = SsdConfig::new(&path, 4096 + DISK_SLOTS * g.disk_slot_bytes()).with_read_depth(8).with_admit_uses(2);
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

    /// Saves 64 fresh blocks (one use each) and returns their keys.
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
    group.bench_function("demote_64", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let keys = s.save_fresh();
                let t0 = Instant::now();
                drop(s.tier.query(&keys)); // the admitting use: all 64 are queued
                s.tier.flush_demotions();
                spent += t0.elapsed();
            }
            spent
        })
    });
    group.bench_function("promote_64_qd8", |b| {
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

/// The disk slots' eviction alone (no I/O): one demotion's slot taken from a full drive (the least
/// recently used block evicted, its index entry removed) and the new block published, at 10,000 and
/// at 1,200,000 disk slots (a 4 TB drive of GLM-5.2 blocks): no scan at either size (the larger
/// one pays cache misses on its bigger arrays, not a walk over them).
fn disk_slot_eviction(c: &mut Criterion) {
    let mut group = c.benchmark_group("disk_slots");
    group.throughput(Throughput::Elements(1));
    for n in [10_000u32, 1_200_000] {
        let (slots, _) = DiskSlots::new(n, &[]);
        let key = |i: u64| ContentKey::from_words(i, i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        for i in 0..u64::from(n) {
            let (d, _) = slots.take(&key(i)).expect("a free disk slot");
            assert!(slots.commit(d, key(i)));
        }
        let mut next = u64::from(n);
        group.bench_function(format!("evict_and_publish_{n}"), |b| {
            b.iter(|| {
                let (d, evicted) = slots.take(&key(next)).expect("an evictable disk slot");
                debug_assert!(evicted.is_some());
                assert!(slots.commit(d, key(next)));
                next += 1;
            })
        });
    }
    group.finish();
}

criterion_group!(benches, ssd, disk_slot_eviction);
criterion_main!(benches);

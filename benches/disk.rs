//! The SSD tier's disk slot file: write and verified read of GLM-5.2 blocks (3,452,160 B, a
//! 3,452,928 B stride) on one thread, one transfer at a time (queue depth 1, `pwrite`/`pread`),
//! `O_DIRECT` where the filesystem takes it. A write includes copying the block into the aligned
//! staging buffer and its XXH3-64; a read includes the trailer and payload checks and the copy out.
//!
//! The file (64 slots, 221 MB) goes in `KVTIER_DISK_BENCH_DIR` (default `target/disk-bench`), so
//! the bench measures the drive under that directory. `fio` at the same block size and depth on
//! the same filesystem is the ceiling to hold these figures against (docs/benchmarks.md gives the
//! command). GB = 10^9 B.
//!
//! `cargo bench --bench disk`

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvtier::internals::disk::{DiskFile, DiskFileConfig, IoPreference};
use kvtier::{ContentKey, Namespace};

const PAYLOAD: u64 = 3_452_160;
const SLOTS: u64 = 64;

fn disk(c: &mut Criterion) {
    let dir = PathBuf::from(std::env::var_os("KVTIER_DISK_BENCH_DIR").unwrap_or_else(|| "target/disk-bench".into()));
    std::fs::create_dir_all(&dir).expect("the bench directory");
    let path = dir.join("bench.kvt");
    let _ = std::fs::remove_file(&path);
    let namespace = Namespace::from_description(b"kvtier disk bench");
    let config = DiskFileConfig {
        path: path.clone(),
        namespace,
        payload_bytes: PAYLOAD,
        slots: SLOTS,
        io: IoPreference::Direct,
    };
    let (file, _) = DiskFile::open_or_create(&config).expect("the bench file");
    eprintln!("disk bench: {} ({:?} transfers)", path.display(), file.mode());
    let payload: Vec<u8> = (0..PAYLOAD).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8).collect();
    let key = |slot: u64| ContentKey::from_words(slot, 0xd15c);
    for slot in 0..SLOTS {
        file.write(slot, key(slot), slot, &payload).expect("filling the file");
    }

    let mut group = c.benchmark_group("disk_glm52");
    group.throughput(Throughput::Bytes(PAYLOAD));
    let mut next = 0u64;
    group.bench_function("write_qd1", |b| {
        b.iter(|| {
            let slot = next % SLOTS;
            next += 1;
            file.write(slot, key(slot), slot, &payload).expect("a write");
        })
    });
    // Rewrite every slot with generation = slot so the reads below verify.
    for slot in 0..SLOTS {
        file.write(slot, key(slot), slot, &payload).expect("refilling the file");
    }
    let mut out = vec![0u8; PAYLOAD as usize];
    group.bench_function("read_verified_qd1", |b| {
        b.iter_batched(
            || {
                next += 1;
                next % SLOTS
            },
            |slot| file.read(slot, key(slot), slot, &mut out).expect("a verified read"),
            BatchSize::SmallInput,
        )
    });
    group.finish();
    let counts = file.io_counts();
    eprintln!("disk bench: {} direct and {} buffered transfers", counts.direct, counts.buffered);
    drop(file);
    let _ = std::fs::remove_file(&path);
}

criterion_group!(benches, disk);
criterion_main!(benches);

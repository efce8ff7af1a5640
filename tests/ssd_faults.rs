//! The SSD tier's failure paths (issue 45, items 5-7): a ring whose `io_uring_enter` fails (made
//! to fail for real by a seccomp filter on the submitting thread, which needs no privilege), a
//! drive read that fails, a tier dropped with demotions queued, a truncated file, a block that
//! fails verification and a restart, a configuration refused after its file was made, and a panic
//! in a promotion. Files go under cargo's target tmpdir (the build disk, where O_DIRECT works).
//!
//! The ring's tests need io_uring: where the kernel refuses a ring (`kernel.io_uring_disabled`, a
//! container's seccomp profile) they are skipped with a message, and with
//! `KVTIER_REQUIRE_IO_URING=1` (CI sets it) they fail instead.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

mod common;

use common::*;
use kvtier::internals::disk::{BatchEngine, DiskError, DiskFile, DiskFileConfig, IoPreference, ReadRequest};
use kvtier::{ContentKey, EngineArenas, Error, HostTier, Namespace, PolicyKind, SsdConfig, WaitFor};
use std::path::{Path, PathBuf};

// --- a seccomp filter on one thread -----------------------------------------------------------

/// A system call the filter makes fail.
#[derive(Clone, Copy)]
enum Deny {
    /// Every call of this number fails with this errno.
    Always(libc::c_long, i32),
    /// Calls of this number whose second argument (its low 32 bits) is this value fail.
    WhenArg1Is(libc::c_long, u32, i32),
}

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7;

const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const BPF_JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K
const RET_ALLOW: u32 = 0x7fff_0000;
const RET_ERRNO: u32 = 0x0005_0000;

fn op(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// Installs a seccomp filter on the calling thread only (and the threads it starts afterwards)
/// that makes the `rules`' calls fail; everything else is allowed. Needs no privilege (the thread
/// sets `no_new_privs` first).
fn deny_on_this_thread(rules: &[Deny]) {
    let mut prog = vec![
        op(BPF_LD_W_ABS, 0, 0, 4), // arch
        op(BPF_JEQ_K, 1, 0, AUDIT_ARCH),
        op(BPF_RET_K, 0, 0, RET_ALLOW),
        op(BPF_LD_W_ABS, 0, 0, 0), // nr
    ];
    for rule in rules {
        match *rule {
            Deny::Always(nr, errno) => {
                prog.push(op(BPF_JEQ_K, 0, 1, nr as u32));
                prog.push(op(BPF_RET_K, 0, 0, RET_ERRNO | errno as u32));
            }
            Deny::WhenArg1Is(nr, value, errno) => {
                prog.push(op(BPF_JEQ_K, 0, 4, nr as u32));
                prog.push(op(BPF_LD_W_ABS, 0, 0, 24)); // args[1], low word
                prog.push(op(BPF_JEQ_K, 0, 1, value));
                prog.push(op(BPF_RET_K, 0, 0, RET_ERRNO | errno as u32));
                prog.push(op(BPF_LD_W_ABS, 0, 0, 0)); // nr again
            }
        }
    }
    prog.push(op(BPF_RET_K, 0, 0, RET_ALLOW));
    let fprog = libc::sock_fprog { len: prog.len() as u16, filter: prog.as_mut_ptr() };
    // SAFETY: prctl with integer arguments; then a filter program that lives across the call (the
    // kernel copies it). Neither touches memory of ours otherwise. Without SECCOMP_FILTER_FLAG_TSYNC
    // the filter applies to this thread only.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0, "PR_SET_NO_NEW_PRIVS");
        let r = libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &fprog as *const libc::sock_fprog);
        assert_eq!(r, 0, "seccomp filter: {}", std::io::Error::last_os_error());
    }
}

/// Runs `f` on a fresh thread under a seccomp filter denying `rules`, and returns its result.
fn under_filter<T: Send>(rules: &[Deny], f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            deny_on_this_thread(rules);
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

const ENTER_FAILS: Deny = Deny::Always(libc::SYS_io_uring_enter, libc::EIO);

/// Whether this machine gives a process an io_uring (the ring's tests skip without one, unless
/// `KVTIER_REQUIRE_IO_URING=1`).
fn io_uring_available(test: &str) -> bool {
    if io_uring::IoUring::new(4).is_ok() {
        return true;
    }
    let required = std::env::var("KVTIER_REQUIRE_IO_URING").is_ok_and(|v| v == "1");
    assert!(!required, "KVTIER_REQUIRE_IO_URING=1 but the kernel refuses an io_uring here");
    eprintln!("SKIPPED {test}: the kernel refuses an io_uring here (kernel.io_uring_disabled, a seccomp profile)");
    false
}

// --- disk files ---------------------------------------------------------------------------------

fn tmpdir() -> tempfile::TempDir {
    let base = env!("CARGO_TARGET_TMPDIR");
    std::fs::create_dir_all(base).expect("the target tmpdir");
    tempfile::tempdir_in(base).expect("a temporary directory on the build disk")
}

fn namespace() -> Namespace {
    Namespace::from_description(b"kvtier ssd fault tests")
}

fn disk_config(path: &Path, payload: u64, slots: u64) -> DiskFileConfig {
    DiskFileConfig {
        path: path.to_path_buf(),
        namespace: namespace(),
        payload_bytes: payload,
        slots,
        io: IoPreference::default(),
    }
}

fn key_of(slot: u64) -> ContentKey {
    namespace().key_from_bytes(&slot.to_le_bytes())
}

fn payload_of(slot: u64, bytes: u64) -> Vec<u8> {
    let mut x = slot.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..bytes)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn flip_byte(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, offset).unwrap();
    byte[0] ^= 0x40;
    file.write_all_at(&byte, offset).unwrap();
}

/// A file of `slots` blocks of `payload` bytes, each slot holding its own block, slot `bad`'s
/// payload corrupted.
fn written_file(path: &Path, payload: u64, slots: u64, bad: u64) -> u64 {
    let (file, _) = DiskFile::open_or_create(&disk_config(path, payload, slots)).unwrap();
    for slot in 0..slots {
        file.write(slot, key_of(slot), slot, &payload_of(slot, payload)).unwrap();
    }
    let stride = file.header().stride;
    drop(file);
    flip_byte(path, 4096 + bad * stride + 10);
    stride
}

/// Reads every slot of `file` in one batch and checks each result: the sound blocks served
/// byte for byte, `bad` refused as unverified without a byte written.
fn check_batch(file: &DiskFile, payload: u64, slots: u64, bad: u64, depth: usize, label: &str) -> BatchEngine {
    let requests: Vec<ReadRequest> =
        (0..slots).map(|s| ReadRequest { slot: s, key: key_of(s), generation: s }).collect();
    let mut bufs: Vec<Vec<u8>> = vec![vec![0xa5u8; payload as usize]; slots as usize];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let report = file.read_batch(&requests, &mut outs, depth, BatchEngine::IoUring).unwrap();
    for (s, result) in report.results.iter().enumerate() {
        let s = s as u64;
        match result {
            Ok(()) if s != bad => {
                assert!(bufs[s as usize] == payload_of(s, payload), "{label}: slot {s} served wrong bytes")
            }
            Ok(()) => panic!("{label}: the corrupted slot {s} was served"),
            Err(DiskError::Unverified { .. }) if s == bad => {
                assert!(bufs[s as usize].iter().all(|&b| b == 0xa5), "{label}: a refused block wrote its buffer")
            }
            Err(e) => panic!("{label}: a sound block was not served after the ring failed: slot {s}: {e}"),
        }
    }
    assert_eq!(file.staging_in_use(), 0, "{label}: the batch's staging buffers were not given back");
    report.engine
}

#[test]
fn a_ring_whose_enter_fails_reads_the_batch_on_threads_and_frees_its_buffers() {
    if !io_uring_available("a_ring_whose_enter_fails_reads_the_batch_on_threads_and_frees_its_buffers") {
        return;
    }
    let dir = tmpdir();
    let path = dir.path().join("ring.kvt");
    let payload = 3 * 4096 + 1000;
    written_file(&path, payload, 8, 5);
    let (file, _) = DiskFile::open_or_create(&disk_config(&path, payload, 8)).unwrap();
    // Every io_uring_enter of the reading thread fails: the ring is set up, nothing is submitted.
    let engine = under_filter(&[ENTER_FAILS], || check_batch(&file, payload, 8, 5, 4, "enter fails"));
    assert_eq!(engine, BatchEngine::Threads, "the batch said it went through the ring");
    assert!(file.ring_failed());
    // Later batches of the file go on threads, on any thread.
    assert_eq!(check_batch(&file, payload, 8, 5, 4, "a later batch"), BatchEngine::Threads);
    // A ring that works, on a fresh open, for comparison.
    drop(file);
    let (file, _) = DiskFile::open_or_create(&disk_config(&path, payload, 8)).unwrap();
    assert_eq!(check_batch(&file, payload, 8, 5, 4, "a working ring"), BatchEngine::IoUring);
    assert!(!file.ring_failed());
}

#[test]
fn a_ring_that_fails_with_reads_in_flight_waits_for_them_before_freeing_their_buffers() {
    if !io_uring_available("a_ring_that_fails_with_reads_in_flight_waits_for_them_before_freeing_their_buffers") {
        return;
    }
    let dir = tmpdir();
    let path = dir.path().join("inflight.kvt");
    // 1 MiB strides: direct reads of the build disk that are still in flight when the first
    // completion is reaped.
    let payload = (1 << 20) - 4096;
    let slots = 16;
    written_file(&path, payload, slots, 3);
    for round in 0..6 {
        let (file, _) = DiskFile::open_or_create(&disk_config(&path, payload, slots)).unwrap();
        // The first enter submits the batch; every enter that only waits (nothing to submit)
        // fails, with the rest of the batch in flight.
        let deny = [Deny::WhenArg1Is(libc::SYS_io_uring_enter, 0, libc::EIO)];
        under_filter(&deny, || check_batch(&file, payload, slots, 3, 16, &format!("round {round}")));
    }
}

// --- the SSD tier -------------------------------------------------------------------------------

/// `small_geometry`'s 5,120 B slots take 8,192 B on disk.
const DISK_SLOT: u64 = 8192;

fn file_bytes(slots: u64) -> u64 {
    4096 + slots * DISK_SLOT
}

fn tier_over(path: &Path, host: u64, disk: u64, admit: u32) -> Result<HostTier, Error> {
    HostTier::new(
        tier_config(host, PolicyKind::Lru)
            .with_chain_aware(false)
            .with_ssd(SsdConfig::new(path, file_bytes(disk)).with_admit_uses(admit)),
    )
}

fn restore_and_verify(tier: &HostTier, lease: &kvtier::Lease, keys: &[ContentKey]) {
    let b = arenas();
    let rank = tier.attach(b.backend().unwrap()).unwrap();
    let pages: Vec<u64> = (0..lease.len() as u64).map(|i| 10 + i).collect();
    rank.restore(lease, &pages, WaitFor::Nothing).unwrap().wait().unwrap();
    b.verify(&pages, &keys[..lease.len()]).unwrap();
}

/// A tier at `path` (8 host slots, 8 disk slots, every block demoted) whose blocks `0..n` are on
/// disk only (the host evicted them). Returns the tier and the keys.
fn on_disk_only(path: &Path, n: u64) -> (HostTier, Vec<ContentKey>) {
    let tier = tier_over(path, 8, 8, 1).unwrap();
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..n);
    let pages: Vec<u64> = (0..n).collect();
    let _ = save_filled(&rank, &a, &k, &pages);
    tier.flush_demotions();
    assert_eq!(tier.evict(8), n as usize);
    (tier, k)
}

fn ssd_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("tier.kvtier")
}

#[test]
fn a_promotion_whose_ring_fails_serves_every_block_through_threads_and_drops_none() {
    if !io_uring_available("a_promotion_whose_ring_fails_serves_every_block_through_threads_and_drops_none") {
        return;
    }
    let dir = tmpdir();
    let (tier, k) = on_disk_only(&ssd_path(&dir), 6);
    let (len, promoted) = under_filter(&[ENTER_FAILS], || {
        let lease = tier.query(&k);
        (lease.len(), lease.promoted())
    });
    let s = tier.ssd_stats().unwrap();
    assert_eq!((len, promoted), (6, 6), "the ring's failure lost blocks of the lease");
    assert_eq!((s.promoted_blocks, s.promotion_failures, s.blocks), (6, 0, 6), "{s:?}");
    let lease = tier.query(&k);
    assert_eq!((lease.len(), lease.promoted()), (6, 0), "the promoted blocks are host blocks now");
    restore_and_verify(&tier, &lease, &k);
}

#[test]
fn a_block_that_could_not_be_read_stays_on_disk_and_is_served_later() {
    let dir = tmpdir();
    let (tier, k) = on_disk_only(&ssd_path(&dir), 4);
    // The ring fails and so does every pread: no block can be read.
    let deny = [ENTER_FAILS, Deny::Always(libc::SYS_pread64, libc::EIO)];
    let len = under_filter(&deny, || tier.query(&k).len());
    assert_eq!(len, 0);
    let s = tier.ssd_stats().unwrap();
    assert_eq!((s.promotion_failures, s.blocks), (1, 4), "a block that was never read was dropped: {s:?}");
    let lease = tier.query(&k);
    assert_eq!((lease.len(), lease.promoted()), (4, 4), "a block that was never read was dropped");
    restore_and_verify(&tier, &lease, &k);
}

#[test]
fn dropping_a_tier_stops_its_demotion_thread_and_releases_the_file_before_it_returns() {
    let dir = tmpdir();
    let path = ssd_path(&dir);
    let mut refused = 0;
    for _ in 0..50 {
        // A round after a refused reopening waits for the file to be let go.
        let started = std::time::Instant::now();
        let tier = loop {
            match tier_over(&path, 48, 64, 1) {
                Ok(t) => break t,
                Err(Error::Ssd(DiskError::InUse { .. })) if started.elapsed().as_secs() < 5 => {
                    std::thread::sleep(std::time::Duration::from_millis(1))
                }
                Err(e) => panic!("{e}"),
            }
        };
        let a = arenas();
        let rank = tier.attach(a.backend().unwrap()).unwrap();
        let k = keys(&tier, 0..48);
        let pages: Vec<u64> = (0..48).collect();
        // 48 demotions queued; the tier is dropped while the demotion thread writes them.
        let _ = save_filled(&rank, &a, &k, &pages);
        drop(rank);
        drop(tier);
        match tier_over(&path, 48, 64, 1) {
            Ok(again) => drop(again),
            Err(Error::Ssd(DiskError::InUse { .. })) => refused += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(refused, 0, "a dropped tier still held its file: {refused} reopenings of 50 refused");
}

#[test]
fn a_truncated_file_keeps_its_whole_slots_at_the_restart() {
    let dir = tmpdir();
    let path = ssd_path(&dir);
    let k = {
        let tier = tier_over(&path, 8, 8, 1).unwrap();
        let a = arenas();
        let rank = tier.attach(a.backend().unwrap()).unwrap();
        let k = keys(&tier, 0..6);
        let _ = save_filled(&rank, &a, &k, &[0, 1, 2, 3, 4, 5]);
        tier.flush_demotions();
        k
    };
    // Demotions take the lowest free disk slots first: k0..k5 are in slots 0..5. Cut slot 4 in
    // its middle (its trailer is gone): slots 0..3 are whole.
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(4096 + 4 * DISK_SLOT + 1000).unwrap();
    drop(file);
    let tier = match tier_over(&path, 8, 8, 1) {
        Ok(t) => t,
        Err(e) => panic!("a truncated file refused the restart: {e}"),
    };
    let s = tier.ssd_stats().unwrap();
    assert_eq!((s.recovered_blocks, s.blocks, s.recovered_torn), (4, 4, 4), "{s:?}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), file_bytes(8), "the file was not extended again");
    let lease = tier.query(&k);
    assert_eq!((lease.len(), lease.promoted()), (4, 4));
    restore_and_verify(&tier, &lease, &k);
    // The regained slots take blocks again.
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let more = keys(&tier, 100..104);
    let _ = save_filled(&rank, &a, &more, &[20, 21, 22, 23]);
    tier.flush_demotions();
    let s = tier.ssd_stats().unwrap();
    assert_eq!((s.blocks, s.disk_evictions, s.demotion_failures), (8, 0, 0), "{s:?}");
}

/// The disk slot holding `key` in the tier file at `path`, found by the file's own trailer scan.
fn disk_slot_of(path: &Path, key: &ContentKey) -> u64 {
    let g = small_geometry();
    let cfg = DiskFileConfig {
        path: path.to_path_buf(),
        namespace: g.namespace(),
        payload_bytes: g.slot_bytes(),
        slots: g.disk_slots(std::fs::metadata(path).unwrap().len()),
        io: IoPreference::Buffered,
    };
    let (_, scan) = DiskFile::open_or_create(&cfg).unwrap();
    scan.blocks.iter().find(|b| b.key == *key).expect("the key is on disk").slot
}

/// Writes blocks `0..n` to a fresh tier file at `path` (then closed) and corrupts `bad`'s payload.
fn file_with_a_corrupted_block(path: &Path, n: u64, disk: u64, bad: usize) -> Vec<ContentKey> {
    let tier = tier_over(path, 8, disk, 1).unwrap();
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..n);
    let pages: Vec<u64> = (0..n).collect();
    let _ = save_filled(&rank, &a, &k, &pages);
    tier.flush_demotions();
    drop((rank, tier));
    flip_byte(path, 4096 + disk_slot_of(path, &k[bad]) * DISK_SLOT + 777);
    k
}

#[test]
fn a_block_that_failed_verification_is_not_recovered_at_the_next_restart() {
    let dir = tmpdir();
    let path = ssd_path(&dir);
    let k = file_with_a_corrupted_block(&path, 4, 8, 1);
    {
        let tier = tier_over(&path, 8, 8, 1).unwrap();
        assert_eq!(tier.ssd_stats().unwrap().recovered_blocks, 4, "the scan reads trailers only");
        let lease = tier.query(&k);
        assert_eq!(lease.len(), 1, "the corrupted block ends the run");
        let s = tier.ssd_stats().unwrap();
        assert_eq!((s.promotion_failures, s.blocks), (1, 3));
    }
    let tier = tier_over(&path, 8, 8, 1).unwrap();
    let s = tier.ssd_stats().unwrap();
    assert_eq!(
        (s.recovered_blocks, s.recovered_torn),
        (3, 0),
        "a block that failed verification was recovered again: {s:?}"
    );
    let lease = tier.query(&k[2..]);
    assert_eq!((lease.len(), lease.promoted()), (2, 2));
    restore_and_verify(&tier, &lease, &k[2..]);
}

#[test]
fn a_configuration_refused_after_its_file_was_made_leaves_no_file() {
    let dir = tmpdir();
    let path = dir.path().join("refused.kvtier");
    // The SSD file is made before the core, whose index refuses this capacity.
    let config = tier_config(8, PolicyKind::Lru)
        .with_index_capacity(usize::MAX)
        .with_ssd(SsdConfig::new(&path, file_bytes(4)).with_admit_uses(1));
    let err = HostTier::new(config).unwrap_err();
    assert!(matches!(err, Error::Tier(_)), "{err}");
    assert!(!path.exists(), "a refused configuration left its SSD file behind");
    // An existing file is never removed by a refusal.
    drop(tier_over(&path, 8, 4, 1).unwrap());
    let config = tier_config(8, PolicyKind::Lru)
        .with_index_capacity(usize::MAX)
        .with_ssd(SsdConfig::new(&path, file_bytes(4)).with_admit_uses(1));
    assert!(HostTier::new(config).is_err());
    assert!(path.exists(), "a refusal removed a file it did not make");
}

/// A tracing subscriber that panics on the promotion's warning about a block that failed
/// verification: a panic in the middle of a promotion, on the querying thread only.
struct PanicOnPromotionWarning;

impl tracing::Subscriber for PanicOnPromotionWarning {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let m = event.metadata();
        if *m.level() == tracing::Level::WARN && m.target().contains("ssd") {
            panic!("a panic in the promotion (its log line)");
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn a_panic_in_a_promotion_releases_its_disk_pins() {
    let dir = tmpdir();
    let path = ssd_path(&dir);
    // A full disk of 4 slots: k0..k3, k1 corrupted.
    let k = file_with_a_corrupted_block(&path, 4, 4, 1);
    let tier = tier_over(&path, 8, 4, 1).unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tracing::subscriber::with_default(PanicOnPromotionWarning, || tier.query(&k).len())
    }));
    assert!(panicked.is_err(), "the promotion did not panic");
    // Every disk pin is gone: four new blocks take the free slot (k1's) and evict k0, k2 and k3
    // (pinned ones would be passed over, and the new blocks evicted instead).
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let more = keys(&tier, 100..104);
    let _ = save_filled(&rank, &a, &more, &[0, 1, 2, 3]);
    tier.flush_demotions();
    assert_eq!(tier.stats().pinned_slots, 0);
    assert_eq!(tier.evict(8), 4);
    let lease = tier.query(&more);
    let s = tier.ssd_stats().unwrap();
    assert_eq!(
        (lease.len(), lease.promoted(), s.demoted_blocks, s.disk_evictions),
        (4, 4, 4, 3),
        "the disk slots a panicked promotion pinned can no longer be evicted: {s:?}"
    );
    restore_and_verify(&tier, &lease, &more);
}

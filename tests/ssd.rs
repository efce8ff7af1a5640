//! The SSD tier under a host tier: demotion, promotion (one lease over both tiers), host eviction
//! preferring clean blocks, restart, corrupted and foreign files, bad options. Every block that
//! comes back is restored to host arenas and checked byte for byte. The files go under cargo's
//! target tmpdir (the build disk), sized for the CI machine (a few hundred KiB).

mod common;

use common::*;
use kvtier::internals::disk::{DiskFile, DiskFileConfig};
use kvtier::{
    ArenaSpec, DiskError, EngineArenas, Error, Geometry, HostTier, IoPreference, PolicyKind, SsdConfig, TierConfig,
    WaitFor,
};
use std::path::{Path, PathBuf};

/// `small_geometry`'s 5,120 B slots take 8,192 B on disk (payload and trailer, rounded to 4 KiB).
const DISK_SLOT: u64 = 8192;

fn tmpdir() -> tempfile::TempDir {
    let base = env!("CARGO_TARGET_TMPDIR");
    std::fs::create_dir_all(base).expect("the target tmpdir");
    tempfile::tempdir_in(base).expect("a temporary directory on the build disk")
}

/// Bytes of an SSD file of `slots` disk slots.
fn file_bytes(slots: u64) -> u64 {
    4096 + slots * DISK_SLOT
}

/// A tier of `host` slots (LRU, no chain ranking) over an SSD file of `disk` slots at `path`.
fn tier_over(path: &Path, host: u64, disk: u64, admit: u32) -> HostTier {
    HostTier::new(
        tier_config(host, PolicyKind::Lru)
            .with_chain_aware(false)
            .with_ssd(SsdConfig::new(path, file_bytes(disk)).with_admit_uses(admit)),
    )
    .unwrap()
}

/// Restores `lease` (all its blocks) into pages `10..` of fresh arenas and checks them against
/// `keys` byte for byte.
fn restore_and_verify(tier: &HostTier, lease: &kvtier::Lease, keys: &[kvtier::ContentKey]) {
    let b = arenas();
    let rank = tier.attach(b.backend().unwrap()).unwrap();
    let pages: Vec<u64> = (0..lease.len() as u64).map(|i| 10 + i).collect();
    rank.restore(lease, &pages, WaitFor::Nothing).unwrap().wait().unwrap();
    b.verify(&pages, &keys[..lease.len()]).unwrap();
}

/// The disk slot holding `key` in the file at `path`, found by the file's own trailer scan.
fn disk_slot_of(path: &Path, key: &kvtier::ContentKey) -> u64 {
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

fn flip_byte(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, offset).unwrap();
    byte[0] ^= 0x40;
    file.write_all_at(&byte, offset).unwrap();
}

fn ssd_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("tier.kvtier")
}

#[test]
fn evicted_blocks_come_back_from_the_ssd_in_one_lease_over_both_tiers() {
    let dir = tmpdir();
    let tier = tier_over(&ssd_path(&dir), 4, 8, 1);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..5);
    let _ = save_filled(&rank, &a, &k[..4], &[0, 1, 2, 3]);
    tier.flush_demotions();
    let s = tier.ssd_stats().unwrap();
    assert_eq!((s.capacity, s.blocks, s.demoted_blocks, s.bytes_demoted), (8, 4, 4, 4 * 5120));
    assert_eq!(tier.evict(4), 4);
    // The host holds k0 and k1 again; k2 and k3 are on disk only; k4 nowhere.
    let _ = save_filled(&rank, &a, &k[..2], &[0, 1]);
    assert!(!tier.contains(&k[2]) && !tier.contains(&k[3]));
    let lease = tier.query(&k);
    assert_eq!((lease.len(), lease.promoted()), (4, 2), "two host blocks, then two promoted ones");
    assert_eq!(tier.stats().pinned_slots, 4, "the promoted blocks are pinned for the lease");
    restore_and_verify(&tier, &lease, &k);
    let s = tier.ssd_stats().unwrap();
    assert_eq!((s.promoted_blocks, s.bytes_promoted, s.promotion_failures), (2, 2 * 5120, 0));
    assert!(tier.contains(&k[2]) && tier.contains(&k[3]), "promoted blocks are host blocks now");
    assert_eq!(s.io_direct + s.io_buffered, 4 + 2, "four writes and two reads");
    let t = tier.stats();
    assert_eq!((t.hit_blocks, t.miss_blocks, t.pinned_slots), (4, 1, 0));
}

#[test]
fn a_promotion_reads_only_the_blocks_the_host_lacks_and_the_lease_continues_from_the_host() {
    let dir = tmpdir();
    let tier = tier_over(&ssd_path(&dir), 4, 8, 1);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..4);
    let _ = save_filled(&rank, &a, &k, &[0, 1, 2, 3]);
    tier.flush_demotions();
    // Every block is on disk; the host lost k0 only (the least recently used).
    assert_eq!(tier.evict(1), 1);
    assert!(!tier.contains(&k[0]) && tier.contains(&k[1]));
    let lease = tier.query(&k);
    let origin: Vec<bool> = (0..lease.len()).map(|i| lease.is_promoted(i)).collect();
    assert_eq!(
        (lease.len(), lease.promoted(), origin),
        (4, 1, vec![true, false, false, false]),
        "a promotion re-read blocks the host holds"
    );
    assert_eq!(tier.ssd_stats().unwrap().promoted_blocks, 1);
    restore_and_verify(&tier, &lease, &k);
}

#[test]
fn a_block_is_demoted_at_its_admitting_use_and_not_before() {
    let dir = tmpdir();
    let tier = tier_over(&ssd_path(&dir), 8, 8, 3);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..4);
    let _ = save_filled(&rank, &a, &k, &[0, 1, 2, 3]);
    // Use 1 is the save, use 2 a query: three are needed.
    drop(tier.query(&k[..2]));
    tier.flush_demotions();
    assert_eq!(tier.ssd_stats().unwrap().demoted_blocks, 0, "two uses of three do not admit a block");
    drop(tier.query(&k[..2]));
    tier.flush_demotions();
    let s = tier.ssd_stats().unwrap();
    assert_eq!((s.demoted_blocks, s.blocks), (2, 2), "the third use admits k0 and k1 only");
    drop(tier.query(&k[..2]));
    tier.flush_demotions();
    assert_eq!(tier.ssd_stats().unwrap().demoted_blocks, 2, "a block is written once");
}

#[test]
fn host_eviction_takes_blocks_with_a_disk_copy_before_dirty_ones() {
    let dir = tmpdir();
    let tier = tier_over(&ssd_path(&dir), 4, 8, 2);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..6);
    let _ = save_filled(&rank, &a, &k[..4], &[0, 1, 2, 3]);
    // k2 and k3 are used again: demoted (clean), and the most recently used.
    drop(tier.query(&k[2..3]));
    drop(tier.query(&k[3..4]));
    tier.flush_demotions();
    assert_eq!(tier.ssd_stats().unwrap().demoted_blocks, 2);
    // Two more blocks need two slots: LRU alone would take k0 and k1, which only the host holds.
    let _ = save_filled(&rank, &a, &k[4..6], &[4, 5]);
    let held: Vec<bool> = k.iter().map(|key| tier.contains(key)).collect();
    assert_eq!(held, [true, true, false, false, true, true], "the clean blocks k2 and k3 were evicted");
    let lease = tier.query(&k[2..4]);
    assert_eq!((lease.len(), lease.promoted()), (2, 2));
    restore_and_verify(&tier, &lease, &k[2..4]);
}

#[test]
fn a_reopened_tier_finds_its_blocks_on_disk_and_serves_them_verified() {
    let dir = tmpdir();
    let path = ssd_path(&dir);
    let k = {
        let tier = tier_over(&path, 8, 8, 1);
        let a = arenas();
        let rank = tier.attach(a.backend().unwrap()).unwrap();
        let k = keys(&tier, 0..6);
        let _ = save_filled(&rank, &a, &k, &[0, 1, 2, 3, 4, 5]);
        tier.flush_demotions();
        k
    };
    let tier = tier_over(&path, 8, 8, 1);
    let s = tier.ssd_stats().unwrap();
    assert_eq!((s.recovered_blocks, s.blocks, s.recovered_torn, s.recovered_foreign), (6, 6, 0, 0));
    assert_eq!(tier.stats().ready_slots, 0, "the host pool starts empty");
    let lease = tier.query(&k);
    assert_eq!((lease.len(), lease.promoted()), (6, 6));
    restore_and_verify(&tier, &lease, &k);
}

#[test]
fn a_corrupted_payload_or_trailer_on_disk_is_never_served() {
    let dir = tmpdir();
    let path = ssd_path(&dir);
    let k = {
        let tier = tier_over(&path, 8, 8, 1);
        let a = arenas();
        let rank = tier.attach(a.backend().unwrap()).unwrap();
        let k = keys(&tier, 0..4);
        let _ = save_filled(&rank, &a, &k, &[0, 1, 2, 3]);
        tier.flush_demotions();
        k
    };
    // One payload byte of k1, one trailer byte of k3 (the trailer is the slot's last 96 B).
    flip_byte(&path, 4096 + disk_slot_of(&path, &k[1]) * DISK_SLOT + 777);
    flip_byte(&path, 4096 + disk_slot_of(&path, &k[3]) * DISK_SLOT + DISK_SLOT - 96 + 20);
    let tier = tier_over(&path, 8, 8, 1);
    let s = tier.ssd_stats().unwrap();
    assert_eq!((s.recovered_blocks, s.recovered_torn), (3, 1), "the torn trailer frees its slot at the scan");
    let lease = tier.query(&k);
    assert_eq!((lease.len(), lease.promoted()), (1, 1), "a corrupted block was served");
    restore_and_verify(&tier, &lease, &k);
    let s = tier.ssd_stats().unwrap();
    assert_eq!((s.promotion_failures, s.blocks), (1, 2), "the corrupted block is dropped from disk");
    assert!(!tier.contains(&k[1]), "nothing of the corrupted block is left on the host");
    let lease = tier.query(&k[2..]);
    assert_eq!((lease.len(), lease.promoted()), (1, 1), "k2 verifies, k3's slot is free");
    restore_and_verify(&tier, &lease, &k[2..]);
    kvtier::internals::core(&tier).audit(&k).unwrap();
}

#[test]
fn the_drive_evicts_its_least_recently_used_block_when_full() {
    let dir = tmpdir();
    let tier = tier_over(&ssd_path(&dir), 8, 3, 1);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..5);
    let _ = save_filled(&rank, &a, &k, &[0, 1, 2, 3, 4]);
    tier.flush_demotions();
    let s = tier.ssd_stats().unwrap();
    assert_eq!((s.demoted_blocks, s.disk_evictions, s.blocks), (5, 2, 3));
    assert_eq!(tier.evict(8), 5);
    assert_eq!(tier.query(&k[..1]).len(), 0, "k0 went first from the drive");
    let lease = tier.query(&k[2..]);
    assert_eq!((lease.len(), lease.promoted()), (3, 3));
    restore_and_verify(&tier, &lease, &k[2..]);
}

#[test]
fn a_file_another_tier_holds_is_refused_and_keeps_its_blocks() {
    let dir = tmpdir();
    let path = ssd_path(&dir);
    let first = tier_over(&path, 4, 4, 1);
    let a = arenas();
    let rank = first.attach(a.backend().unwrap()).unwrap();
    let k = keys(&first, 0..2);
    let _ = save_filled(&rank, &a, &k, &[0, 1]);
    first.flush_demotions();
    let second = HostTier::new(
        tier_config(4, PolicyKind::Lru).with_ssd(SsdConfig::new(&path, file_bytes(4)).with_admit_uses(1)),
    );
    let Err(err) = second else { panic!("a second tier opened a file the first holds") };
    assert!(matches!(err, Error::Ssd(DiskError::InUse { .. })), "{err}");
    // The first tier's blocks are intact, and once it is gone the file opens again.
    assert_eq!(first.evict(4), 2);
    let lease = first.query(&k);
    assert_eq!(lease.promoted(), 2);
    restore_and_verify(&first, &lease, &k);
    drop((lease, rank, first));
    assert_eq!(tier_over(&path, 4, 4, 1).ssd_stats().unwrap().recovered_blocks, 2);
}

#[test]
fn files_of_another_namespace_or_bad_options_are_refused_with_typed_errors() {
    let dir = tmpdir();
    let path = ssd_path(&dir);
    drop(tier_over(&path, 4, 4, 2));
    // Same slot size, another model: another namespace.
    let other = Geometry::new("another-model", 16, vec![ArenaSpec::packed("kv", 5120, 64)]).unwrap();
    let config = |ssd: SsdConfig| {
        TierConfig::new(other.clone(), 4 * other.slot_bytes()).with_backing(kvtier::BackingChoice::Plain).with_ssd(ssd)
    };
    let err = HostTier::new(config(SsdConfig::new(&path, file_bytes(4)))).unwrap_err();
    assert!(matches!(err, Error::Ssd(DiskError::OtherGeometry { .. })), "{err}");
    let small = dir.path().join("small.kvtier");
    let err = HostTier::new(config(SsdConfig::new(&small, 4096 + 100))).unwrap_err();
    assert!(matches!(err, Error::Ssd(DiskError::BadConfig(_))), "{err}");
    assert!(err.to_string().contains("holds no block"), "{err}");
    assert!(!small.exists(), "nothing is made for a refused configuration");
    let err = HostTier::new(config(SsdConfig::new(&small, file_bytes(2)).with_admit_uses(0))).unwrap_err();
    assert!(matches!(err, Error::Ssd(DiskError::BadConfig(_))), "{err}");
    // A refused second file leaves no first one behind: a size refused before anything is made,
    // a file refused at its opening (here the same path twice: the first holds its lock).
    let fresh = dir.path().join("fresh.kvtier");
    let err = HostTier::new(config(SsdConfig::new(&fresh, file_bytes(2)).with_file(&small, 100))).unwrap_err();
    assert!(matches!(err, Error::Ssd(DiskError::BadConfig(_))), "{err}");
    let err =
        HostTier::new(config(SsdConfig::new(&fresh, file_bytes(2)).with_file(&fresh, file_bytes(2)))).unwrap_err();
    assert!(matches!(err, Error::Ssd(DiskError::InUse { .. })), "{err}");
    assert!(!fresh.exists() && !small.exists(), "a refused configuration left a file behind");
    // The file of the first tier is untouched and still opens for its own namespace.
    let tier = tier_over(&path, 4, 4, 2);
    assert_eq!(tier.ssd_stats().unwrap().capacity, 4);
}

#[test]
fn the_event_log_follows_every_block_stored_and_evicted_on_the_host_and_on_disk() {
    use kvtier::{EventMedium::*, TierEvent};
    let dir = tmpdir();
    // 4 host slots over 2 disk slots, every block demoted at its first use.
    let tier = HostTier::new(
        tier_config(4, PolicyKind::Lru)
            .with_chain_aware(false)
            .with_ssd(SsdConfig::new(ssd_path(&dir), file_bytes(2)).with_admit_uses(1))
            .with_events(64),
    )
    .unwrap();
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..5);
    let _ = save_filled(&rank, &a, &k[..2], &[0, 1]);
    tier.flush_demotions();
    let mut events = Vec::new();
    assert_eq!(tier.take_events(&mut events), 0, "nothing lost");
    let stored = |k: &kvtier::ContentKey, medium| TierEvent::Stored { key: *k, medium };
    let removed = |k: &kvtier::ContentKey, medium| TierEvent::Removed { key: *k, medium };
    assert_eq!(events, [stored(&k[0], Host), stored(&k[1], Host), stored(&k[0], Disk), stored(&k[1], Disk)]);
    // Two more blocks demoted: the disk evicts the two oldest; then the host evicts all four.
    events.clear();
    let _ = save_filled(&rank, &a, &k[2..4], &[2, 3]);
    tier.flush_demotions();
    assert_eq!(tier.evict(4), 4);
    tier.take_events(&mut events);
    let (host, disk): (Vec<&TierEvent>, Vec<&TierEvent>) = events
        .iter()
        .partition(|e| matches!(e, TierEvent::Stored { medium: Host, .. } | TierEvent::Removed { medium: Host, .. }));
    assert_eq!(host[..2], [&stored(&k[2], Host), &stored(&k[3], Host)]);
    let mut host_removed: Vec<_> = host[2..].iter().map(|e| **e).collect();
    host_removed.sort_by_key(|e| format!("{e:?}"));
    let mut want: Vec<_> = k[..4].iter().map(|k| removed(k, Host)).collect();
    want.sort_by_key(|e| format!("{e:?}"));
    assert_eq!(host_removed, want, "every host eviction is announced");
    let mut disk: Vec<_> = disk.into_iter().copied().collect();
    disk.sort_by_key(|e| format!("{e:?}"));
    let mut want = vec![stored(&k[2], Disk), stored(&k[3], Disk), removed(&k[0], Disk), removed(&k[1], Disk)];
    want.sort_by_key(|e| format!("{e:?}"));
    assert_eq!(disk, want, "the disk's stores and evictions are announced");
    // A full log drops and counts; a tier without one records nothing.
    let small = HostTier::new(tier_config(4, PolicyKind::Lru).with_events(1)).unwrap();
    let rank = small.attach(a.backend().unwrap()).unwrap();
    let k = keys(&small, 0..3);
    let _ = save_filled(&rank, &a, &k, &[0, 1, 2]);
    events.clear();
    assert_eq!(small.take_events(&mut events), 2, "two of three stores dropped");
    assert_eq!(events, [stored(&k[0], Host)]);
    let none = HostTier::new(tier_config(4, PolicyKind::Lru)).unwrap();
    let rank = none.attach(a.backend().unwrap()).unwrap();
    let _ = save_filled(&rank, &a, &keys(&none, 0..2), &[0, 1]);
    events.clear();
    assert_eq!((none.take_events(&mut events), events.len()), (0, 0));
}

/// `SsdAdmit::Auto` on a drive that has not evicted admits after 1 use: the save itself queues
/// the block, as `with_admit_uses(1)` does, and a bad admission text is a typed error.
#[test]
fn an_auto_admission_writes_saved_blocks_while_the_drive_has_room() {
    let dir = tmpdir();
    let tier = HostTier::new(
        tier_config(8, PolicyKind::Lru)
            .with_chain_aware(false)
            .with_ssd(SsdConfig::new(ssd_path(&dir), file_bytes(8)).with_admit(kvtier::SsdAdmit::Auto)),
    )
    .unwrap();
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..3);
    let _ = save_filled(&rank, &a, &k, &[0, 1, 2]);
    tier.flush_demotions();
    let s = tier.ssd_stats().unwrap();
    assert_eq!((s.demoted_blocks, s.blocks), (3, 3), "auto admits every saved block while the drive has room");
    let e = "0".parse::<kvtier::SsdAdmit>().unwrap_err();
    assert!(e.to_string().contains("neither `auto` nor a number of uses"), "{e}");
}

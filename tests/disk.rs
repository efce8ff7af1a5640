//! The SSD tier's disk slot files: restart, corruption, foreign files, bad input and a writer
//! killed at random points. Files go under cargo's target tmpdir (the build disk), where the
//! filesystem takes O_DIRECT.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use kvtier::internals::disk::{
    BatchEngine, DiskError, DiskFile, DiskFileConfig, IoMode, IoPreference, ReadRequest, TRAILER_BYTES,
};
use kvtier::{ContentKey, Namespace};

/// A payload that does not fill its last page, so the trailer shares it with payload bytes.
const PAYLOAD: u64 = 3 * 4096 + 1000;
const STRIDE: u64 = 4 * 4096;

fn namespace() -> Namespace {
    Namespace::from_description(b"kvtier disk tests")
}

fn config(path: &Path, slots: u64) -> DiskFileConfig {
    DiskFileConfig {
        path: path.to_path_buf(),
        namespace: namespace(),
        payload_bytes: PAYLOAD,
        slots,
        io: IoPreference::default(),
    }
}

fn key_of(generation: u64) -> ContentKey {
    namespace().key_from_bytes(&generation.to_le_bytes())
}

/// The bytes of the block written with `generation`: a xorshift stream seeded by it.
fn payload_of(generation: u64, bytes: u64) -> Vec<u8> {
    let mut x = generation.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..bytes)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn tmpdir() -> tempfile::TempDir {
    // cargo makes this directory before it runs the tests; a test binary run elsewhere makes it.
    let base = env!("CARGO_TARGET_TMPDIR");
    std::fs::create_dir_all(base).expect("the target tmpdir");
    tempfile::tempdir_in(base).expect("a temporary directory on the build disk")
}

fn flip_byte(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, offset).unwrap();
    byte[0] ^= 0x01;
    file.write_all_at(&byte, offset).unwrap();
}

fn slot_offset(slot: u64) -> u64 {
    4096 + slot * STRIDE
}

#[test]
fn blocks_written_before_a_close_are_found_and_verified_after_reopening() {
    let dir = tmpdir();
    let path = dir.path().join("tier.kvt");
    let (file, scan) = DiskFile::open_or_create(&config(&path, 8)).unwrap();
    assert_eq!((scan.blocks.len(), scan.blank), (0, 8));
    assert_eq!(file.header().stride, STRIDE);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 4096 + 8 * STRIDE, "the file is preallocated whole");
    for generation in [3u64, 5, 6] {
        file.write(generation, key_of(generation), generation, &payload_of(generation, PAYLOAD)).unwrap();
    }
    let mode = file.mode();
    let counts = file.io_counts();
    drop(file);

    let (file, scan) = DiskFile::open_or_create(&config(&path, 8)).unwrap();
    let found: Vec<(u64, ContentKey, u64)> = scan.blocks.iter().map(|b| (b.slot, b.key, b.generation)).collect();
    assert_eq!(found, vec![(3, key_of(3), 3), (5, key_of(5), 5), (6, key_of(6), 6)]);
    assert_eq!((scan.blank, scan.torn, scan.foreign), (5, 0, 0));
    for block in &scan.blocks {
        let mut out = vec![0u8; PAYLOAD as usize];
        file.read(block.slot, block.key, block.generation, &mut out).unwrap();
        assert_eq!(out, payload_of(block.generation, PAYLOAD), "slot {}", block.slot);
    }
    // The build disk takes O_DIRECT; every transfer went the way the mode says.
    if mode == IoMode::Direct {
        assert_eq!((counts.direct, counts.buffered), (3, 0));
    } else {
        assert_eq!((counts.direct, counts.buffered), (0, 3));
    }

    // A cleared slot is free for both the scan and a read.
    file.clear(5).unwrap();
    let err = file.read(5, key_of(5), 5, &mut vec![0u8; PAYLOAD as usize]).unwrap_err();
    assert!(matches!(err, DiskError::Unverified { slot: 5, .. }), "{err}");
    assert_eq!(file.scan().unwrap().blocks.len(), 2);
}

#[test]
fn a_flipped_byte_in_a_payload_or_a_trailer_is_never_served() {
    let dir = tmpdir();
    let path = dir.path().join("tier.kvt");
    let (file, _) = DiskFile::open_or_create(&config(&path, 4)).unwrap();
    for slot in 0..4 {
        file.write(slot, key_of(slot), slot, &payload_of(slot, PAYLOAD)).unwrap();
    }
    drop(file);
    flip_byte(&path, slot_offset(1) + 17); // payload, first page
    flip_byte(&path, slot_offset(2) + PAYLOAD - 1); // payload, last byte (beside the trailer)
    flip_byte(&path, slot_offset(3) + STRIDE - TRAILER_BYTES as u64 + 40); // trailer: the key

    let (file, scan) = DiskFile::open_or_create(&config(&path, 4)).unwrap();
    // The scan reads trailers only: slots 1 and 2 look sound there, slot 3 is torn.
    let found: Vec<u64> = scan.blocks.iter().map(|b| b.slot).collect();
    assert_eq!(found, vec![0, 1, 2], "a slot with a corrupted trailer was taken for a block");
    assert_eq!(scan.torn, 1);
    for slot in 1..4 {
        let sentinel = vec![0xa5u8; PAYLOAD as usize];
        let mut out = sentinel.clone();
        let Err(err) = file.read(slot, key_of(slot), slot, &mut out) else {
            panic!("slot {slot}: a corrupted slot was served");
        };
        assert!(matches!(err, DiskError::Unverified { .. }), "slot {slot}: {err}");
        assert!(out == sentinel, "slot {slot}: a refused read wrote into the caller's buffer");
    }
    let mut out = vec![0u8; PAYLOAD as usize];
    file.read(0, key_of(0), 0, &mut out).unwrap();
    assert_eq!(out, payload_of(0, PAYLOAD));
    // Another key or another generation of a sound slot is not served either.
    let err = file.read(0, key_of(1), 0, &mut out).unwrap_err();
    assert!(matches!(err, DiskError::Unverified { .. }), "{err}");
    let err = file.read(0, key_of(0), 1, &mut out).unwrap_err();
    assert!(matches!(err, DiskError::Unverified { .. }), "{err}");
}

#[test]
fn a_file_of_another_geometry_or_not_ours_is_refused_and_left_alone() {
    let dir = tmpdir();
    let path = dir.path().join("tier.kvt");
    let (file, _) = DiskFile::open_or_create(&config(&path, 4)).unwrap();
    file.write(0, key_of(0), 0, &payload_of(0, PAYLOAD)).unwrap();
    drop(file);
    let before = std::fs::read(&path).unwrap();

    let other_namespace =
        DiskFileConfig { namespace: Namespace::from_description(b"another model"), ..config(&path, 4) };
    let other_size = DiskFileConfig { payload_bytes: PAYLOAD + 1, ..config(&path, 4) };
    for wanted in [other_namespace, other_size, config(&path, 5)] {
        let err = DiskFile::open_or_create(&wanted).unwrap_err();
        assert!(matches!(err, DiskError::OtherGeometry { .. }), "{err}");
    }
    assert!(std::fs::read(&path).unwrap() == before, "a refused open changed the file");

    let stranger = dir.path().join("notes.txt");
    std::fs::write(&stranger, vec![b'x'; 8192]).unwrap();
    let err = DiskFile::open_or_create(&config(&stranger, 4)).unwrap_err();
    assert!(matches!(err, DiskError::NotADiskFile { .. }), "{err}");
    assert!(err.to_string().contains("magic bytes are not kvtier's"), "{err}");
    assert_eq!(std::fs::read(&stranger).unwrap(), vec![b'x'; 8192]);
    let short = dir.path().join("short.kvt");
    std::fs::write(&short, b"KVT").unwrap();
    let err = DiskFile::open_or_create(&config(&short, 4)).unwrap_err();
    assert!(matches!(err, DiskError::NotADiskFile { .. }), "{err}");
}

#[test]
fn bad_arguments_get_typed_errors() {
    let dir = tmpdir();
    let path = dir.path().join("tier.kvt");
    for bad in [config(&path, 0), DiskFileConfig { payload_bytes: 0, ..config(&path, 4) }] {
        let err = DiskFile::open_or_create(&bad).unwrap_err();
        assert!(matches!(err, DiskError::BadConfig(_)), "{err}");
    }
    let huge = DiskFileConfig { slots: u64::MAX / 2, ..config(&path, 4) };
    assert!(matches!(DiskFile::open_or_create(&huge).unwrap_err(), DiskError::BadConfig(_)));
    assert!(!path.exists(), "a refused configuration left a file");
    let missing_dir = DiskFileConfig { path: dir.path().join("no/such/dir/tier.kvt"), ..config(&path, 4) };
    let err = DiskFile::open_or_create(&missing_dir).unwrap_err();
    assert!(matches!(err, DiskError::Io { .. }) && err.to_string().contains("creating the file"), "{err}");

    let (file, _) = DiskFile::open_or_create(&config(&path, 4)).unwrap();
    let payload = payload_of(1, PAYLOAD);
    let err = file.write(4, key_of(1), 1, &payload).unwrap_err();
    assert!(matches!(err, DiskError::SlotOutOfRange { slot: 4, slots: 4 }), "{err}");
    let err = file.write(0, key_of(1), 1, &payload[1..]).unwrap_err();
    assert!(matches!(err, DiskError::PayloadSize { .. }), "{err}");
    let err = file.read(0, key_of(1), 1, &mut [0u8; 10]).unwrap_err();
    assert!(matches!(err, DiskError::PayloadSize { got: 10, .. }), "{err}");
    assert!(matches!(file.clear(9).unwrap_err(), DiskError::SlotOutOfRange { .. }));
}

#[test]
fn buffered_transfers_when_asked_for_and_direct_ones_by_default() {
    let dir = tmpdir();
    let path = dir.path().join("tier.kvt");
    let asked = DiskFileConfig { io: IoPreference::Buffered, ..config(&path, 2) };
    let (file, _) = DiskFile::open_or_create(&asked).unwrap();
    assert_eq!(file.mode(), IoMode::Buffered);
    file.write(1, key_of(1), 1, &payload_of(1, PAYLOAD)).unwrap();
    let mut out = vec![0u8; PAYLOAD as usize];
    file.read(1, key_of(1), 1, &mut out).unwrap();
    assert_eq!(out, payload_of(1, PAYLOAD));
    assert_eq!((file.io_counts().direct, file.io_counts().buffered), (0, 2));
    drop(file);
    // The same file reopened with the default: direct where the filesystem takes it (ext4, xfs,
    // and tmpfs since Linux 6.6), and the block written buffered reads back the same.
    let (file, _) = DiskFile::open_or_create(&config(&path, 2)).unwrap();
    file.read(1, key_of(1), 1, &mut out).unwrap();
    assert_eq!(out, payload_of(1, PAYLOAD));
    let counts = file.io_counts();
    match file.mode() {
        IoMode::Direct => assert_eq!((counts.direct, counts.buffered), (3, 0), "2 scan reads and 1 read"),
        IoMode::Buffered => assert_eq!((counts.direct, counts.buffered), (0, 3)),
    }
}

#[test]
fn a_batched_read_at_depth_verifies_each_block_with_either_engine() {
    let dir = tmpdir();
    let path = dir.path().join("tier.kvt");
    let (file, _) = DiskFile::open_or_create(&config(&path, 8)).unwrap();
    for slot in 0..8 {
        file.write(slot, key_of(slot), slot, &payload_of(slot, PAYLOAD)).unwrap();
    }
    drop(file);
    flip_byte(&path, slot_offset(5) + 100); // slot 5's payload
    let (file, _) = DiskFile::open_or_create(&config(&path, 8)).unwrap();
    // Slots 0-7 in a shuffled order, then slot 2 asked with a wrong generation and slot 9 (out of
    // range).
    let mut requests: Vec<ReadRequest> =
        [3u64, 0, 7, 5, 1, 6, 2, 4].iter().map(|&s| ReadRequest { slot: s, key: key_of(s), generation: s }).collect();
    requests.push(ReadRequest { slot: 2, key: key_of(2), generation: 99 });
    requests.push(ReadRequest { slot: 9, key: key_of(9), generation: 9 });
    for engine in [BatchEngine::IoUring, BatchEngine::Threads] {
        for depth in [1, 4, 16] {
            let mut bufs: Vec<Vec<u8>> = vec![vec![0xa5u8; PAYLOAD as usize]; requests.len()];
            let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            let report = file.read_batch(&requests, &mut outs, depth, engine).unwrap();
            let label = format!("{engine:?} (ran {:?}) at depth {depth}", report.engine);
            for (i, (req, result)) in requests.iter().zip(&report.results).enumerate() {
                let sound = req.slot != 5 && req.generation == req.slot && req.slot < 8;
                match result {
                    Ok(()) if sound => assert!(bufs[i] == payload_of(req.slot, PAYLOAD), "{label}: slot {}", req.slot),
                    Ok(()) => panic!("{label}: a corrupted or wrong block was served: request {i} {req:?}"),
                    Err(e) if sound => panic!("{label}: request {i}: {e}"),
                    Err(e) => {
                        assert!(
                            matches!(e, DiskError::Unverified { .. } | DiskError::SlotOutOfRange { slot: 9, .. }),
                            "{label}: {e}"
                        );
                        assert!(bufs[i].iter().all(|&b| b == 0xa5), "{label}: a refused block wrote its buffer");
                    }
                }
            }
        }
    }
    let mut one = vec![0u8; PAYLOAD as usize];
    let mut outs: Vec<&mut [u8]> = vec![one.as_mut_slice()];
    for depth in [0, 1025] {
        let err = file.read_batch(&requests[..1], &mut outs, depth, BatchEngine::IoUring).unwrap_err();
        assert!(matches!(err, DiskError::BadConfig(_)), "{err}");
    }
    let err = file.read_batch(&requests[..2], &mut outs, 2, BatchEngine::Threads).unwrap_err();
    assert!(matches!(err, DiskError::BadConfig(_)), "{err}");
}

// --- a writer killed at random points --------------------------------------------------------

const CRASH_SLOTS: u64 = 16;
/// 1 MiB strides: long enough writes that a SIGKILL often lands inside one.
const CRASH_PAYLOAD: u64 = (1 << 20) - 4096;
const WRITER_ENV: &str = "KVTIER_DISK_CRASH_WRITER";

fn crash_config(path: &Path, io: IoPreference) -> DiskFileConfig {
    DiskFileConfig {
        path: path.to_path_buf(),
        namespace: namespace(),
        payload_bytes: CRASH_PAYLOAD,
        slots: CRASH_SLOTS,
        io,
    }
}

/// The writer's role, run in a child process the crash test starts (this test binary, re-run
/// with `WRITER_ENV` naming the file, the first generation and the I/O mode). Started by hand, it
/// does nothing.
#[test]
fn crash_writer_role() {
    let Ok(spec) = std::env::var(WRITER_ENV) else { return };
    let (rest, io) = spec.rsplit_once(':').expect("PATH:FIRST_GENERATION:direct|buffered");
    let (path, first) = rest.rsplit_once(':').expect("PATH:FIRST_GENERATION");
    let first: u64 = first.parse().expect("a generation");
    let io = if io == "buffered" { IoPreference::Buffered } else { IoPreference::Direct };
    let (file, _) = DiskFile::open_or_create(&crash_config(Path::new(path), io)).unwrap();
    println!("writer ready");
    for generation in first.. {
        let slot = generation.wrapping_mul(7) % CRASH_SLOTS;
        file.write(slot, key_of(generation), generation, &payload_of(generation, CRASH_PAYLOAD)).unwrap();
    }
}

#[test]
fn a_writer_killed_at_random_points_leaves_only_verified_blocks_or_free_slots() {
    let dir = tmpdir();
    let path: PathBuf = dir.path().join("crash.kvt");
    drop(DiskFile::open_or_create(&crash_config(&path, IoPreference::Direct)).unwrap());
    let exe = std::env::current_exe().unwrap();
    let mut seed = 0x2545_f491_4f6c_dd1d_u64 ^ u64::from(std::process::id());
    let (mut verified, mut refused, mut wrong, mut torn_trailers) = (0u64, 0u64, 0u64, 0u64);
    let rounds = 24;
    for round in 0..rounds {
        let first = round * 1_000_000;
        // A direct write is not cut short by SIGKILL (the block layer finishes it); a buffered one
        // is, between pages, so the odd rounds leave torn slots behind.
        let io = if round % 2 == 0 { "direct" } else { "buffered" };
        let mut child = Command::new(&exe)
            .args(["--exact", "crash_writer_role", "--nocapture", "--test-threads=1"])
            .env(WRITER_ENV, format!("{}:{first}:{io}", path.display()))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Wait for the writer to have opened the file, then let it write for 5-60 ms.
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut lines = std::io::BufRead::lines(out).map_while(Result::ok);
        assert!(lines.any(|l| l.contains("writer ready")), "the writer did not start");
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(Duration::from_micros(5_000 + seed % 55_000));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();

        let (file, scan) = DiskFile::open_or_create(&crash_config(&path, IoPreference::Direct)).unwrap();
        torn_trailers += scan.torn;
        assert_eq!(scan.foreign, 0);
        for block in &scan.blocks {
            let mut out = vec![0u8; CRASH_PAYLOAD as usize];
            match file.read(block.slot, block.key, block.generation, &mut out) {
                Ok(())
                    if block.key == key_of(block.generation) && out == payload_of(block.generation, CRASH_PAYLOAD) =>
                {
                    verified += 1
                }
                Ok(()) => wrong += 1,
                Err(DiskError::Unverified { .. }) => refused += 1,
                Err(e) => panic!("round {round}: slot {}: {e}", block.slot),
            }
        }
    }
    println!(
        "{rounds} kills: {verified} blocks verified, {refused} refused (torn payload), {torn_trailers} torn trailers, \
         {wrong} wrong blocks accepted"
    );
    assert_eq!(wrong, 0, "a block whose bytes are not its key's was served");
    assert!(verified > 0, "the writer never completed a block");
}

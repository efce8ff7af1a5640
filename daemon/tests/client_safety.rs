//! What one client process cannot do to the others through a connected tier, and what a client
//! refuses: a client cannot resize the pool's memfd under the other engines' mappings; a child
//! forked after the connection is refused before it sends anything on its parent's session; a
//! request over the frame limit is refused before it is sent and the connection goes on; a socket
//! served by a process of another uid gets no hello. Every wait is bounded (`support::DEADLINE`).

mod support;

use kvtier::BackendKind;
use kvtier::{ConnectOptions, ContentKey, EngineArenas, Error, HostTier, Limit, Rank, TierError, WaitFor};
use nix::libc;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use support::{Daemon, DEADLINE};

/// GPU pages of a client's (host) arenas: sources from 0, restore destinations from 32.
const PAGES: u64 = 64;

fn keys(tier: &HostTier, range: std::ops::Range<u64>) -> Vec<ContentKey> {
    range.map(|i| tier.namespace().trace_page_key(i, 0)).collect()
}

fn host_rank(tier: &HostTier) -> (Arc<dyn EngineArenas>, Rank) {
    let arenas = BackendKind::Host.arenas(0, &tier.geometry().with_pages(PAGES).unwrap()).unwrap();
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    (arenas, rank)
}

/// Saves `keys` from pages `0..n` (filled first) and waits.
fn save_all(tier: &HostTier, keys: &[ContentKey]) -> (Arc<dyn EngineArenas>, Rank) {
    let (arenas, rank) = host_rank(tier);
    let pages: Vec<u64> = (0..keys.len() as u64).collect();
    arenas.fill(&pages, keys).unwrap();
    let t = rank.save(keys, &pages, WaitFor::Nothing).unwrap();
    assert_eq!(t.saving.len() + t.resident, keys.len());
    t.handle.wait_timeout(DEADLINE).expect("save completes in time").unwrap();
    (arenas, rank)
}

/// Queries `keys` (all must hit), restores them into pages 32.. and verifies every byte.
fn restore_and_verify(tier: &HostTier, arenas: &dyn EngineArenas, rank: &Rank, keys: &[ContentKey]) {
    let lease = tier.try_query_shared(keys, 1).unwrap();
    assert_eq!(lease.len(), keys.len());
    let dst: Vec<u64> = (32..32 + keys.len() as u64).collect();
    rank.restore(&lease, &dst, WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).expect("in time").unwrap();
    arenas.verify(&dst, keys).unwrap();
}

/// The daemon's audit balances and no slot is left quarantined, pinned or writing.
fn assert_clean(tier: &HostTier, resident: &[ContentKey]) {
    let audit = kvtier::internals::remote_audit(tier, resident).unwrap().unwrap();
    assert_eq!((audit.writing, audit.pinned, audit.evicting), (0, 0, 0), "{audit:?}");
    let s = tier.try_stats().unwrap();
    assert_eq!(s.quarantined_slots, 0, "{s:?}");
}

/// A pipe whose read end a thread drains into a channel (so the test waits for a forked child's
/// report at most [`DEADLINE`]); the write end is for the child.
struct Pipe {
    bytes: Receiver<u8>,
}

impl Pipe {
    /// The pipe and its write end.
    fn new() -> (Pipe, OwnedFd) {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: `fds` is a valid out-array of two ints.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0, "pipe2");
        // SAFETY: pipe2 returned two new descriptors that nothing else owns.
        let (read, write) = unsafe { (std::fs::File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let (tx, bytes) = channel();
        std::thread::spawn(move || {
            for b in std::io::BufReader::new(read).bytes() {
                let Ok(b) = b else { break };
                if tx.send(b).is_err() {
                    break;
                }
            }
        });
        (Pipe { bytes }, write)
    }

    /// The next `n` bytes the child wrote; panics past [`DEADLINE`] or if the child closed the pipe.
    fn read(&self, n: usize, what: &str) -> Vec<u8> {
        (0..n)
            .map(|_| {
                self.bytes.recv_timeout(DEADLINE).unwrap_or_else(|e| panic!("{what}: no report from the child ({e})"))
            })
            .collect()
    }
}

/// Writes `bytes` to `fd` from a forked child (async-signal-safe: one `write` per call).
fn child_write(fd: RawFd, bytes: &[u8]) {
    // SAFETY: `bytes` is valid for its length; `fd` is the child's copy of the pipe's write end.
    unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
}

/// A forked child: killed (if still running) and reaped when dropped.
struct Forked(libc::pid_t);

impl Forked {
    /// Forks; the child runs `child` (which may only do async-signal-safe work: this process has
    /// other threads) and `_exit`s with its status.
    fn spawn(child: impl FnOnce() -> i32) -> Forked {
        // SAFETY: the child runs only `child`, which does async-signal-safe work, then `_exit`s
        // without running destructors or atexit handlers.
        match unsafe { libc::fork() } {
            -1 => panic!("fork: {}", std::io::Error::last_os_error()),
            0 => {
                let code = child();
                // SAFETY: ends the child at once, as a forked child of a threaded process must.
                unsafe { libc::_exit(code) }
            }
            pid => Forked(pid),
        }
    }

    /// Waits for the child's exit status (the report it sent came first).
    fn wait(self) -> i32 {
        let mut status = 0;
        // SAFETY: `self.0` is our child; `status` is a valid out-pointer.
        assert_eq!(unsafe { libc::waitpid(self.0, &mut status, 0) }, self.0, "waitpid");
        std::mem::forget(self);
        assert!(libc::WIFEXITED(status), "the child did not exit normally: status {status:#x}");
        libc::WEXITSTATUS(status)
    }
}

impl Drop for Forked {
    fn drop(&mut self) {
        // SAFETY: `self.0` is our child, not yet reaped.
        unsafe {
            libc::kill(self.0, libc::SIGKILL);
            libc::waitpid(self.0, std::ptr::null_mut(), 0);
        }
    }
}

/// Item 3: the memfd every client receives is size-sealed, so one client's `ftruncate` fails
/// `EPERM` and the other engines' copies and later connections go on.
#[test]
fn a_client_cannot_resize_the_pool_under_the_others() {
    let d = Daemon::start(16);
    let a = HostTier::connect(&d.socket).unwrap();
    let k = keys(&a, 0..4);
    let (arenas_a, rank_a) = save_all(&a, &k);
    let hostile = HostTier::connect(&d.socket).unwrap();
    let fd = hostile.pool().shared_fd().expect("a connected tier maps the daemon's memfd");
    let len = hostile.pool().mapped_bytes() as i64;
    let seals = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GET_SEALS).unwrap() as u32;
    assert_eq!(seals, kvtier::POOL_SEALS, "the received memfd's seals");
    for size in [0, len / 2, len * 2] {
        assert_eq!(nix::unistd::ftruncate(fd, size), Err(nix::errno::Errno::EPERM), "ftruncate to {size} B");
    }
    assert_eq!(nix::sys::stat::fstat(fd.as_raw_fd()).unwrap().st_size, len);
    // The first engine's copies still land (no SIGBUS), with the right bytes.
    restore_and_verify(&a, &*arenas_a, &rank_a, &k);
    // A later engine connects, maps and restores.
    let c = HostTier::connect(&d.socket).unwrap();
    let (arenas_c, rank_c) = host_rank(&c);
    restore_and_verify(&c, &*arenas_c, &rank_c, &k);
    assert_clean(&c, &k);
}

/// Item 5: a child forked after the connection gets `ForkedChild` from every call, before anything
/// is sent on its parent's session; the parent's session goes on in step.
#[test]
fn a_forked_child_is_refused_before_it_sends_anything() {
    let d = Daemon::start(16);
    let tier = HostTier::connect(&d.socket).unwrap();
    let k = keys(&tier, 0..2);
    let (arenas, rank) = save_all(&tier, &k);
    let queries = tier.try_stats().unwrap().queries;
    let parent = std::process::id();
    let (pipe, write) = Pipe::new();
    let w = write.as_raw_fd();
    let key = k[0];
    let child = Forked::spawn(|| {
        // Only calls that allocate nothing before they are refused (this process had threads).
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() } as u32;
        let forked =
            |e: &TierError| matches!(*e, TierError::ForkedChild { owner, current } if owner == parent && current == me);
        let mut report = 0u8;
        if tier.try_stats().as_ref().is_err_and(forked) {
            report |= 1;
        }
        if tier.try_query_shared(&[], 1).as_ref().is_err_and(forked) {
            report |= 2;
        }
        // `contains` answers false when it cannot ask.
        if !tier.contains(&key) {
            report |= 4;
        }
        child_write(w, &[report]);
        0
    });
    drop(write);
    let report = pipe.read(1, "the forked child")[0];
    assert_eq!(child.wait(), 0);
    assert_eq!(report, 7, "each bit: a call the child was refused (1 stats, 2 query, 4 contains)");
    // The child sent nothing: the daemon counted no query, and the parent's replies are its own.
    assert_eq!(tier.try_stats().unwrap().queries, queries);
    assert!(tier.contains(&key));
    restore_and_verify(&tier, &*arenas, &rank, &k);
    assert_clean(&tier, &k);
}

/// Item 5: the connection's sockets and the pool's memfd are close-on-exec, so a program a client
/// `exec`s inherits none of them.
#[test]
fn a_connections_descriptors_are_close_on_exec() {
    let d = Daemon::start(4);
    let tier = HostTier::connect(&d.socket).unwrap();
    let pool_fd = tier.pool().shared_fd().unwrap().as_raw_fd();
    let mut checked = 0;
    for entry in std::fs::read_dir("/proc/self/fd").unwrap() {
        let entry = entry.unwrap();
        let Ok(target) = std::fs::read_link(entry.path()) else { continue };
        let target = target.to_string_lossy().into_owned();
        if !(target.starts_with("socket:") || target.contains("kvtier-pool")) {
            continue;
        }
        let fd: RawFd = entry.file_name().to_string_lossy().parse().unwrap();
        // Another test's descriptor may be closed meanwhile (EBADF): every one that is open counts.
        // SAFETY: F_GETFD only reads the descriptor's flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        if flags == -1 {
            continue;
        }
        assert_ne!(flags & libc::FD_CLOEXEC, 0, "fd {fd} ({target}) is not close-on-exec");
        checked += 1;
    }
    assert!(checked >= 3, "the connection's two sockets and the pool's memfd (fd {pool_fd}): found {checked}");
}

/// Item 6: a query, save or hint over the daemon's bounds is a typed error raised before anything is
/// sent; the connection, and a save in flight on it, go on.
#[test]
fn a_request_over_the_frame_limit_is_refused_and_the_connection_goes_on() {
    let d = Daemon::start(16);
    let tier = HostTier::connect(&d.socket).unwrap();
    let k = keys(&tier, 0..4);
    let (arenas, rank) = host_rank(&tier);
    let pages: Vec<u64> = (0..4).collect();
    arenas.fill(&pages, &k).unwrap();
    // A save in flight: its finish comes after the refused requests.
    let ticket = rank.save(&k, &pages, WaitFor::Nothing).unwrap();
    assert_eq!(ticket.saving.len(), 4);
    // 4,194,304 keys: 1 + 4 + 16 x 4,194,304 + 1 B > 64 MiB.
    let over: Vec<ContentKey> = (0..1u128 << 22).map(|i| ContentKey::from_bytes(i.to_le_bytes())).collect();
    // The daemon's welcome states its bounds (keys per request: 1,048,576 by default), so the
    // client refuses on keys before it computes the frame; over the frame alone is the unit test
    // `remote::client::tests::a_request_over_the_frame_limit_is_refused_before_anything_is_sent`.
    let frame = |e: TierError| {
        assert!(
            matches!(e, TierError::LimitExceeded { limit: Limit::KeysPerRequest | Limit::FrameBytes, max, asked }
                if asked == 1 << 22 && asked > max),
            "{e}"
        );
    };
    frame(tier.try_query_shared(&over, 1).map(|_| ()).unwrap_err());
    frame(rank.save(&over, &vec![0; over.len()], WaitFor::Nothing).map(|_| ()).unwrap_err());
    // A hint is advice: refused, it protects nothing and costs the connection nothing.
    let _ = tier.hint(&over, std::time::Duration::from_secs(60));
    assert_eq!(tier.live_hints(), 0);
    drop(over);
    ticket.handle.wait_timeout(DEADLINE).expect("the save completes in time").unwrap();
    restore_and_verify(&tier, &*arenas, &rank, &k);
    let s = tier.try_stats().unwrap();
    assert_eq!((s.saved_blocks, s.save_failed_blocks), (4, 0), "{s:?}");
    assert_clean(&tier, &k);
}

/// Item 7: a socket whose listener runs as another uid (one that squatted the path) is refused
/// with `UntrustedDaemon` before the hello (and its namespace) is sent; configured to trust that
/// uid, the client sends its hello.
#[test]
fn a_socket_served_by_another_uid_is_refused_before_the_hello() {
    use nix::sys::socket::{bind, socket, AddressFamily, SockFlag, SockType, UnixAddr};
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipping: running a listener as another uid needs root");
        return;
    }
    const NOBODY: u32 = 65534;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvtierd.sock");
    // Bound here, listening in the child once it runs as `nobody`: SO_PEERCRED names the process
    // that called listen().
    let sock = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
    bind(sock.as_raw_fd(), &UnixAddr::new(&path).unwrap()).unwrap();
    let (pipe, write) = Pipe::new();
    let (w, s) = (write.as_raw_fd(), sock.as_raw_fd());
    let child = Forked::spawn(|| {
        // Raw system calls only (this process had threads). setuid as a syscall changes this
        // thread's credentials, the child's only thread.
        // SAFETY: plain system calls on descriptors the child owns; `buf` is a valid buffer.
        unsafe {
            if libc::syscall(libc::SYS_setgid, NOBODY) != 0 || libc::syscall(libc::SYS_setuid, NOBODY) != 0 {
                return 2;
            }
            if libc::listen(s, 4) != 0 {
                return 3;
            }
            child_write(w, b"L");
            // Two connections: report the bytes each sent (up to its first 4) once it hangs up or
            // has sent 4 bytes, then close it.
            for _ in 0..2 {
                let c = libc::accept(s, std::ptr::null_mut(), std::ptr::null_mut());
                if c < 0 {
                    return 4;
                }
                let mut total = 0u32;
                let mut buf = [0u8; 64];
                while total < 4 {
                    let n = libc::read(c, buf.as_mut_ptr().cast(), buf.len());
                    if n <= 0 {
                        break;
                    }
                    total += n as u32;
                }
                child_write(w, &total.to_le_bytes());
                libc::close(c);
            }
        }
        0
    });
    drop(write);
    assert_eq!(pipe.read(1, "the listener")[0], b'L');
    match HostTier::connect(&path) {
        Err(Error::Tier(TierError::UntrustedDaemon { expected: 0, found: NOBODY })) => {}
        Err(e) => panic!("connecting to a socket of uid {NOBODY}: {e}"),
        Ok(_) => panic!("connected to a socket of uid {NOBODY}"),
    }
    let sent = u32::from_le_bytes(pipe.read(4, "the first connection").try_into().unwrap());
    assert_eq!(sent, 0, "bytes the refused client sent");
    // Trusting that uid, the client sends its hello (the listener then hangs up).
    match HostTier::connect_with(&path, &ConnectOptions::new().expected_uid(NOBODY)) {
        Err(Error::Tier(TierError::Disconnected { .. })) => {}
        Err(e) => panic!("a hello to a trusted listener that hangs up: {e}"),
        Ok(_) => panic!("the listener is no daemon"),
    }
    let sent = u32::from_le_bytes(pipe.read(4, "the second connection").try_into().unwrap());
    assert!(sent >= 4, "the trusting client sent its hello: {sent} B");
    assert_eq!(child.wait(), 0);
}

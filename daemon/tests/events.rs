//! `kvtierd --kv-events`: the KV event socket's bounds, seen from raw TCP connections (the
//! events themselves are decoded by vLLM's own classes in `python/tests/vllm_engine`).

mod support;

use kvtier::{EngineArenas, HostTier, MemcpyArenas, WaitFor};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;
use support::{Daemon, DEADLINE};

/// The KV event address the daemon printed (`..., KV events at tcp://ADDR`).
fn events_addr(d: &Daemon) -> String {
    let at =
        d.line.split("KV events at tcp://").nth(1).unwrap_or_else(|| panic!("no KV event address in {:?}", d.line));
    at.split([',', ' ', '\n']).next().unwrap().to_string()
}

/// Connects and reads the first bytes the publisher sends: its 64-byte ZMTP greeting, or nothing
/// (0) when it closes the connection at once.
fn greeting_bytes(addr: &str) -> (TcpStream, usize) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut buf = [0u8; 64];
    let mut got = 0;
    while got < 64 {
        match s.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("reading from {addr}: {e}"),
        }
    }
    if got == 64 {
        assert_eq!((buf[0], buf[9], buf[10], &buf[12..16]), (0xFF, 0x7F, 3, &b"NULL"[..]), "a ZMTP 3.0 NULL greeting");
    }
    (s, got)
}

#[test]
fn the_event_socket_serves_at_most_its_subscribers_and_a_freed_place_is_taken_again() {
    let d = Daemon::start_args(8, "lru", None, &["--kv-events", "127.0.0.1:0", "--kv-events-subscribers", "2"]);
    let addr = events_addr(&d);
    let (first, n1) = greeting_bytes(&addr);
    let (_second, n2) = greeting_bytes(&addr);
    assert_eq!((n1, n2), (64, 64), "two subscribers get the greeting");
    let (_third, n3) = greeting_bytes(&addr);
    assert_eq!(n3, 0, "a third subscriber is closed at once, not served");
    // A subscriber that leaves frees its place.
    drop(first);
    let mut n = 0;
    let t0 = std::time::Instant::now();
    while n != 64 && t0.elapsed() < DEADLINE {
        std::thread::sleep(Duration::from_millis(20));
        n = greeting_bytes(&addr).1;
    }
    assert_eq!(n, 64, "the place of a subscriber that left is served again");
}

#[test]
fn a_kv_event_socket_off_loopback_needs_a_secret() {
    let out = std::process::Command::new(support::kvtierd_bin())
        .args(["--model", "m", "--page-tokens", "16", "--arena", "kv:4096", "--pool", "1MiB", "--backing", "plain"])
        .args(["--socket", "/nonexistent-dir/x.sock", "--kv-events", "tcp://*:0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--kv-events-secret-file"), "{err}");
}

/// One ZMTP frame from `s`: (flags, body).
fn frame(s: &mut TcpStream) -> (u8, Vec<u8>) {
    let mut head = [0u8; 2];
    s.read_exact(&mut head).expect("a frame's head");
    let len = if head[0] & 0x02 != 0 {
        let mut rest = [0u8; 7];
        s.read_exact(&mut rest).unwrap();
        u64::from_be_bytes([head[1], rest[0], rest[1], rest[2], rest[3], rest[4], rest[5], rest[6]]) as usize
    } else {
        head[1] as usize
    };
    let mut body = vec![0; len];
    s.read_exact(&mut body).unwrap();
    (head[0], body)
}

/// A ZMTP 3.0 PLAIN client's handshake with `password` (RFC 23 and 24, as libzmq's SUB does it):
/// the command the publisher answered HELLO with (`WELCOME` or `ERROR`), and the stream.
fn plain_hello(addr: &str, password: &[u8]) -> (Vec<u8>, TcpStream) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[12..17].copy_from_slice(b"PLAIN");
    s.write_all(&g).unwrap();
    let mut theirs = [0u8; 64];
    s.read_exact(&mut theirs).unwrap();
    assert_eq!((&theirs[12..17], theirs[32]), (&b"PLAIN"[..], 1), "a PLAIN server's greeting");
    let mut hello = b"\x05HELLO\x06kvtier".to_vec();
    hello.push(password.len() as u8);
    hello.extend_from_slice(password);
    let mut f = vec![0x04, hello.len() as u8];
    f.extend_from_slice(&hello);
    s.write_all(&f).unwrap();
    let (flags, body) = frame(&mut s);
    assert_eq!(flags, 0x04, "a command");
    (body, s)
}

#[test]
fn with_a_secret_only_a_subscriber_that_proves_it_gets_the_pools_events() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("events.secret");
    std::fs::write(&path, b"the-event-socket-secret\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let d = Daemon::start_args(
        8,
        "lru",
        None,
        &["--kv-events", "127.0.0.1:0", "--kv-events-secret-file", path.to_str().unwrap()],
    );
    let addr = events_addr(&d);
    // A wrong password: an ERROR command, then the connection closes.
    let (answer, mut wrong) = plain_hello(&addr, b"not-the-secret-at-all");
    assert!(answer.starts_with(b"\x05ERROR"), "a subscriber without the secret is refused: {answer:?}");
    assert_eq!(wrong.read(&mut [0u8; 1]).unwrap_or(0), 0, "and the connection closed");
    // The secret: WELCOME, INITIATE -> READY, a subscription to everything, then the events of a
    // save through the daemon: one batch whose payload names the two keys saved.
    let (answer, mut s) = plain_hello(&addr, b"the-event-socket-secret");
    assert_eq!(answer, b"\x07WELCOME");
    let initiate = b"\x08INITIATE\x0bSocket-Type\x00\x00\x00\x03SUB";
    let mut f = vec![0x04, initiate.len() as u8];
    f.extend_from_slice(initiate);
    s.write_all(&f).unwrap();
    let (flags, ready) = frame(&mut s);
    assert!(flags == 0x04 && ready.starts_with(b"\x05READY"), "{ready:?}");
    s.write_all(&[0x00, 0x01, 0x01]).unwrap(); // subscribe to every topic
    std::thread::sleep(Duration::from_millis(200));
    let tier = HostTier::connect(&d.socket).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&tier.geometry().with_pages(4).unwrap()).unwrap());
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    let keys: Vec<_> = (0..2).map(|i| tier.namespace().trace_page_key(i, 0)).collect();
    rank.save(&keys, &[0, 1], WaitFor::Nothing).unwrap().handle.wait_timeout(DEADLINE).unwrap().unwrap();
    let (topic, seq, payload) = (frame(&mut s), frame(&mut s), frame(&mut s));
    assert_eq!((topic.0, topic.1.as_slice(), seq.0, seq.1.as_slice()), (1, &b""[..], 1, &0u64.to_be_bytes()[..]));
    assert_eq!(payload.0 & 0x01, 0, "the payload ends the message");
    for k in &keys {
        let at = payload.1.windows(16).position(|w| w == k.as_bytes());
        assert!(at.is_some(), "the batch names the saved key {k}");
    }
}

//! `kvtierd --kv-events`: the KV event socket's bounds, seen from raw TCP connections (the
//! events themselves are decoded by vLLM's own classes in `python/tests/vllm_engine`).

mod support;

use std::io::Read;
use std::net::TcpStream;
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
fn a_kv_event_socket_off_loopback_needs_its_flag() {
    let out = std::process::Command::new(support::kvtierd_bin())
        .args(["--model", "m", "--page-tokens", "16", "--arena", "kv:4096", "--pool", "1MiB", "--backing", "plain"])
        .args(["--socket", "/nonexistent-dir/x.sock", "--kv-events", "tcp://*:0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--kv-events-public"), "{err}");
}

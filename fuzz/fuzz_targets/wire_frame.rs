//! The daemon's frame reader over raw bytes (what any process can write to its socket): frames of
//! any announced length, truncated, oversized, undecodable. Nothing panics; the buffer never holds
//! more than the frame bound allows, whatever a length prefix says; a decoded request encodes back
//! to the same request; the client's reply decoder takes the same bytes without panicking.
#![no_main]

use kvtier::internals::proto::{self, Incoming, Reply, Request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&b, rest)) = data.split_first() else { return };
    // The first byte picks the frame bound: 16 B to 32 KiB.
    let max = 16usize << (b % 12);
    let mut r = rest;
    let mut buf = Vec::new();
    for _ in 0..64 {
        match proto::read_request(&mut r, &mut buf, max) {
            Ok(Incoming::Request(req)) => {
                let mut frame = Vec::new();
                proto::encode(&req, &mut frame).expect("a decoded request encodes");
                let back: Request = proto::read_frame(&mut &frame[..], &mut Vec::new()).expect("and decodes back");
                assert_eq!(back, req);
                let _ = req.name();
            }
            Ok(Incoming::Oversized { len }) => assert!(len as usize > max, "{len} B is within {max} B"),
            Ok(Incoming::Undecodable(_)) => {}
            Err(_) => break,
        }
        assert!(buf.capacity() <= 2 * max + 64, "{} B held for a bound of {max} B", buf.capacity());
    }
    // The client's side: a reply payload of any bytes is an error or a reply, never a panic.
    let _ = proto::decode::<Reply>(rest);
});

//! The peer port's frame reader over raw bytes (what anybody who reaches `--peer-listen` can write,
//! before and after the hello): frames of any announced length, truncated, oversized,
//! undecodable. Nothing panics; the buffer never holds more than the frame bound allows, whatever a
//! length prefix says; a decoded request encodes back to the same request; the reader's reply
//! decoder (an owner's bytes) takes the same bytes without panicking, and a decoded reply encodes
//! back to itself.
#![no_main]

use kvtier::internals::peer_proto::{self as proto, Frame, PeerReply, PeerRequest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&b, rest)) = data.split_first() else { return };
    // The first byte picks the frame bound: 16 B to 32 KiB.
    let max = 16usize << (b % 12);
    let mut r = rest;
    let mut buf = Vec::new();
    for _ in 0..64 {
        match proto::read_msg::<PeerRequest>(&mut r, &mut buf, max) {
            Ok(Frame::Msg(req)) => {
                let (mut frame, mut scratch) = (Vec::new(), Vec::new());
                proto::write_msg(&mut frame, &req, &mut scratch).expect("a decoded request encodes");
                match proto::read_msg::<PeerRequest>(&mut &frame[..], &mut Vec::new(), usize::MAX) {
                    Ok(Frame::Msg(back)) => assert_eq!(back, req),
                    other => panic!("a request's frame reads back as {other:?}"),
                }
            }
            Ok(Frame::Oversized(len)) => {
                assert!(len as usize > max, "{len} B is within {max} B");
                // The stream is out of step after an oversized frame: the server closes it.
                break;
            }
            Ok(Frame::Undecodable(_)) => {}
            Err(_) => break,
        }
        assert!(buf.capacity() <= 2 * max + (64 << 10), "{} B held for a bound of {max} B", buf.capacity());
    }
    // The reader's side: an owner's frames of any bytes are an error or a reply, never a panic.
    let mut r = rest;
    let mut buf = Vec::new();
    for _ in 0..16 {
        match proto::read_msg::<PeerReply>(&mut r, &mut buf, max) {
            Ok(Frame::Msg(reply)) => {
                let (mut frame, mut scratch) = (Vec::new(), Vec::new());
                proto::write_msg(&mut frame, &reply, &mut scratch).expect("a decoded reply encodes");
                match proto::read_msg::<PeerReply>(&mut &frame[..], &mut Vec::new(), usize::MAX) {
                    Ok(Frame::Msg(back)) => assert_eq!(back, reply),
                    other => panic!("a reply's frame reads back as {other:?}"),
                }
            }
            Ok(Frame::Undecodable(_)) => {}
            Ok(Frame::Oversized(_)) | Err(_) => break,
        }
    }
});

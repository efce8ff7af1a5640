use super::connection::{name, Io, RequestLimits};
use super::*;
use crate::error::{Limit, TierError};
use crate::key::ContentKey;
use crate::remote::proto::{self, Outcome, Reply, Request};
use std::io::{BufReader, Write};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{channel, Receiver};
use std::sync::Mutex;
use std::time::Duration;

/// A connection to a scripted daemon on the other end of a socket pair: the daemon answers
/// each request that wants a reply with the next of `replies` (then hangs up) and hands every
/// request it received to the returned channel.
fn scripted(replies: Vec<Reply>) -> (Conn, Receiver<Request>) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let mut replies = replies.into_iter();
        let mut r = BufReader::new(theirs.try_clone().unwrap());
        let mut buf = Vec::new();
        while let Ok(req) = proto::read_frame::<Request>(&mut r, &mut buf) {
            let one_way = req.is_one_way();
            let _ = tx.send(req);
            if !one_way {
                let Some(reply) = replies.next() else { break };
                proto::write_frame(&mut proto::NoSigPipe(&theirs), &reply, &mut buf).unwrap();
            }
        }
    });
    let io = Io { reader: BufReader::new(ours.try_clone().unwrap()), writer: ours, buf: Vec::new(), lost: None };
    (Conn { io: Mutex::new(io), instance: 1, pid: std::process::id(), limits: RequestLimits::PROTOCOL }, rx)
}

fn keys(n: usize) -> Vec<ContentKey> {
    (0..n as u64).map(|i| ContentKey(u128::from(i).to_le_bytes())).collect()
}

fn recv(rx: &Receiver<Request>) -> Request {
    rx.recv_timeout(Duration::from_secs(120)).expect("the scripted daemon received a request")
}

/// The largest query that fits in one frame: 1 B variant + 4 B key count + 16 B a key + 1 B
/// uses <= MAX_FRAME.
const MAX_QUERY_KEYS: usize = (proto::MAX_FRAME - 6) / 16;

#[test]
fn a_request_over_the_frame_limit_is_refused_before_anything_is_sent() {
    let (conn, rx) = scripted(vec![Reply::Count(3), Reply::Count(4), Reply::Count(5)]);
    let over = keys(MAX_QUERY_KEYS + 1);
    let e = conn.call(&Request::Query { keys: over.clone(), uses: 1 }).unwrap_err();
    let asked = 6 + 16 * over.len() as u64;
    assert!(
        matches!(e, TierError::LimitExceeded { limit: Limit::FrameBytes, asked: a, max } if a == asked && max == proto::MAX_FRAME as u64),
        "{e}"
    );
    let e = conn.call(&Request::Hint { keys: over.clone(), ttl_ms: 10 }).unwrap_err();
    assert!(matches!(e, TierError::LimitExceeded { limit: Limit::FrameBytes, .. }), "{e}");
    let save = Request::PrepareSave { keys: over, prefix: false, prefix_depth: None, parent: None };
    let e = conn.call(&save).unwrap_err();
    assert!(matches!(e, TierError::LimitExceeded { limit: Limit::FrameBytes, .. }), "{e}");
    // Nothing was sent, and the connection serves the next call.
    assert_eq!(conn.count(&Request::LiveHints).map_err(|e| e.to_string()), Ok(3));
    assert_eq!(recv(&rx), Request::LiveHints);
    // The largest query that fits goes out whole.
    let fits = keys(MAX_QUERY_KEYS);
    assert_eq!(conn.count(&Request::Query { keys: fits.clone(), uses: 1 }).map_err(|e| e.to_string()), Ok(4));
    assert_eq!(recv(&rx), Request::Query { keys: fits, uses: 1 });
    assert_eq!(conn.count(&Request::ExpireLeases).map_err(|e| e.to_string()), Ok(5));
    assert_eq!(recv(&rx), Request::ExpireLeases);
}

#[test]
fn a_request_over_the_connections_bounds_is_refused_before_anything_is_sent() {
    let (mut conn, rx) = scripted(vec![Reply::Count(1)]);
    conn.limits = RequestLimits { frame_bytes: 100, keys_per_request: 8 };
    let e = conn.call(&Request::Hint { keys: keys(9), ttl_ms: 1 }).unwrap_err();
    assert!(matches!(e, TierError::LimitExceeded { limit: Limit::KeysPerRequest, asked: 9, max: 8 }), "{e}");
    // 1 B variant + 1 B count + 8 x 16 B + 1 B uses = 131 B.
    let e = conn.call(&Request::Query { keys: keys(8), uses: 1 }).unwrap_err();
    assert!(matches!(e, TierError::LimitExceeded { limit: Limit::FrameBytes, asked: 131, max: 100 }), "{e}");
    let audit = Request::Audit { keys: keys(5) };
    assert_eq!(conn.count(&audit).map_err(|e| e.to_string()), Ok(1));
    assert_eq!(recv(&rx), audit, "the refused requests sent nothing");
}

#[test]
fn daemon_errors_reach_the_caller_typed_and_keep_the_connection() {
    let limit = proto::WireError::LimitExceeded { limit: Limit::KeysPerRequest, asked: 9, max: 8 };
    let panicked = proto::WireError::Panicked { request: "Evict".into(), message: "boom".into() };
    let (conn, _rx) = scripted(vec![
        Reply::Error(proto::WireError::Protocol("a second hello".into())),
        Reply::Error(limit),
        Reply::Error(panicked),
        Reply::Error(proto::WireError::LeaseSettled),
        Reply::Error(proto::WireError::Other("no save 9 on this connection".into())),
        Reply::Count(7),
    ]);
    let e = conn.call(&Request::Stats).unwrap_err();
    assert!(matches!(&e, TierError::Protocol { reason } if reason == "a second hello"), "{e}");
    let e = conn.call(&Request::Query { keys: keys(9), uses: 1 }).unwrap_err();
    assert!(matches!(e, TierError::LimitExceeded { limit: Limit::KeysPerRequest, asked: 9, max: 8 }), "{e}");
    let e = conn.call(&Request::Evict { blocks: 1 }).unwrap_err();
    assert!(matches!(&e, TierError::Panicked { request, message } if request == "Evict" && message == "boom"));
    let e = conn.call(&Request::ReleaseLease { lease: 3 }).unwrap_err();
    assert!(matches!(e, TierError::LeaseSettled), "{e}");
    let e = conn.call(&Request::FinishSave { save: 9, outcome: Outcome::Done, latency_ns: None }).unwrap_err();
    assert!(matches!(&e, TierError::Protocol { reason } if reason.ends_with("no save 9 on this connection")), "{e}");
    assert_eq!(conn.count(&Request::LiveHints).map_err(|e| e.to_string()), Ok(7));
}

#[test]
fn a_call_from_another_process_is_refused_before_anything_is_sent() {
    let (mut conn, rx) = scripted(vec![Reply::Count(1)]);
    let me = std::process::id();
    conn.pid = me + 1;
    let e = conn.call(&Request::Stats).unwrap_err();
    assert!(matches!(e, TierError::ForkedChild { owner, current } if owner == me + 1 && current == me), "{e}");
    // One-way messages (a lease dropped in the child) are refused too.
    let e = conn.call(&Request::DropLease { lease: 5 }).unwrap_err();
    assert!(matches!(e, TierError::ForkedChild { .. }), "{e}");
    conn.pid = me;
    assert_eq!(conn.count(&Request::LiveHints).map_err(|e| e.to_string()), Ok(1));
    assert_eq!(recv(&rx), Request::LiveHints, "the refused calls sent nothing");
}

#[test]
fn a_garbled_reply_is_a_typed_error() {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let io = Io { reader: BufReader::new(ours.try_clone().unwrap()), writer: ours, buf: Vec::new(), lost: None };
    let conn = Conn { io: Mutex::new(io), instance: 1, pid: std::process::id(), limits: RequestLimits::PROTOCOL };
    std::thread::spawn(move || {
        let mut r = BufReader::new(theirs.try_clone().unwrap());
        let mut buf = Vec::new();
        let _ = proto::read_frame::<Request>(&mut r, &mut buf);
        // A frame whose payload is no reply (an unknown variant), then a length past the limit.
        let mut w = proto::NoSigPipe(&theirs);
        w.write_all(&[1, 0, 0, 0, 250]).unwrap();
        let _ = proto::read_frame::<Request>(&mut r, &mut buf);
    });
    let e = conn.call(&Request::Stats).unwrap_err();
    assert!(matches!(e, TierError::Disconnected { .. }), "{e}");
    // The stream is out of step: every later call says so, without touching the socket.
    let e = conn.call(&Request::Stats).unwrap_err();
    assert!(matches!(e, TierError::Disconnected { .. }), "{e}");
}

#[test]
fn request_names_are_short() {
    assert_eq!(name(&Request::Query { keys: keys(100_000), uses: 1 }), "Query");
    assert_eq!(name(&Request::Stats), "Stats");
    assert_eq!(name(&Request::Evict { blocks: 3 }), "Evict");
}

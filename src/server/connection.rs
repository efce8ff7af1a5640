//! One connection's thread ([`serve`]): the hello and its answer (the pool's memfd with the
//! welcome), then the frame loop that runs each request through the connection's [`Session`] until
//! the client closes, a read or write fails or times out, or the process that said hello is gone.

use super::peer::{peer_process, ShowPid};
use super::session::Session;
use super::shared::{ConnSlot, SessionCount, Shared};
use crate::error::Limit;
use crate::remote::proto::{self, Incoming, Reply, Request, WireError};
use std::io::{BufReader, IoSlice, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A connection's frame buffers are given back past this capacity, bytes (an idle connection holds
/// at most this much after a large request).
const KEEP_BUFFER: usize = 1 << 20;

/// Sends the hello's answer: the marker byte (with the memfd when accepted), then the reply frame.
pub(super) fn send_answer(
    stream: &UnixStream,
    shared: &Shared,
    reply: &Reply,
    buf: &mut Vec<u8>,
) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let accepted = matches!(reply, Reply::Welcome(_));
    let marker = [if accepted { proto::MARKER_POOL } else { proto::MARKER_REFUSED }];
    let iov = [IoSlice::new(&marker)];
    let fd = shared.core.pool().shared_fd().expect("checked at bind").as_raw_fd();
    let fds = [fd];
    let cmsgs = [ControlMessage::ScmRights(&fds)];
    let cmsgs: &[ControlMessage<'_>] = if accepted { &cmsgs } else { &[] };
    sendmsg::<()>(stream.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None).map_err(std::io::Error::from)?;
    proto::write_frame(&mut proto::NoSigPipe(stream), reply, buf)
}

fn hello_reply(shared: &Shared, req: &Incoming) -> Reply {
    match req {
        Incoming::Request(Request::Hello { magic, version, namespace }) => {
            if *magic != proto::MAGIC || *version != proto::PROTOCOL_VERSION {
                return Reply::Error(WireError::ProtocolMismatch { daemon: proto::PROTOCOL_VERSION, client: *version });
            }
            let ours = shared.welcome.namespace;
            if namespace.is_some_and(|n| n != ours) {
                return Reply::Error(WireError::GeometryMismatch {
                    backend: "the client's geometry (another namespace)".into(),
                    tier: shared.welcome.model.clone(),
                });
            }
            Reply::Welcome(shared.welcome.clone())
        }
        Incoming::Oversized { len } => Reply::Error(WireError::LimitExceeded {
            limit: Limit::FrameBytes,
            asked: *len,
            max: proto::MAX_HELLO as u64,
        }),
        _ => Reply::Error(WireError::Protocol("the first message must be a hello".into())),
    }
}

/// A reader that fails with [`std::io::ErrorKind::TimedOut`] once `until` has passed (each read of
/// the socket below blocks at most its `SO_RCVTIMEO`): a frame cannot take for ever to arrive.
struct Deadline<'a, R> {
    inner: &'a mut R,
    until: Instant,
}

impl<R: Read> Read for Deadline<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if Instant::now() >= self.until {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        match self.inner.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Err(std::io::ErrorKind::TimedOut.into()),
            r => r,
        }
    }
}

/// What ended a wait for the next frame.
enum Wake {
    /// Bytes (or the end of the stream) arrived.
    Readable,
    /// The process that said hello is gone.
    Gone,
}

/// Longest a connection's thread spins for the next request before it sleeps in `poll`: an
/// engine's requests come in bursts (a query, then the restore it found; the restore's finish one
/// copy later), and a request caught spinning is served without a thread wake-up (5-15 us). At
/// most 200 us after each request, less with `KVTIER_WAIT_SPIN_US` (0: sleep at once).
fn next_request_spin() -> Duration {
    crate::sync::wait_spin().min(Duration::from_micros(200))
}

/// Waits until the socket is readable or the process behind `pidfd` has exited, polling without
/// sleeping for the first `spin`.
fn wait_next(sock: RawFd, pidfd: Option<RawFd>, spin: Duration) -> std::io::Result<Wake> {
    let mut fds = [
        libc::pollfd { fd: sock, events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: pidfd.unwrap_or(-1), events: libc::POLLIN, revents: 0 },
    ];
    let start = Instant::now();
    let mut timeout = if spin.is_zero() { -1 } else { 0 };
    loop {
        // SAFETY: two valid pollfds (a negative fd is ignored by poll); poll writes only their
        // `revents`.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
        if n == 0 {
            // Nothing yet (only with timeout 0): spin on, or sleep once the spin is over.
            if start.elapsed() >= spin {
                timeout = -1;
            }
            std::hint::spin_loop();
            continue;
        }
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            return Ok(Wake::Gone);
        }
        if fds[0].revents != 0 {
            return Ok(Wake::Readable);
        }
    }
}

pub(super) fn serve(shared: Arc<Shared>, stream: &UnixStream, _slot: ConnSlot) {
    let limits = shared.limits;
    let (peer, pidfd) = peer_process(stream);
    let pid = peer.pid;
    let who = ShowPid(pid);
    let write_timeout = (!crate::seeded::seeded("no-write-timeout")).then_some(limits.write_timeout);
    if stream.set_read_timeout(Some(limits.hello_timeout)).is_err() || stream.set_write_timeout(write_timeout).is_err()
    {
        return;
    }
    let mut buf = Vec::new();
    let mut reader = BufReader::new(stream);
    let hello = {
        let mut r = Deadline { inner: &mut reader, until: Instant::now() + limits.hello_timeout };
        // An oversized hello is refused at once: its bytes are not worth waiting for.
        let read = proto::read_len(&mut r).and_then(|len| {
            if len > proto::MAX_HELLO {
                return Ok(Incoming::Oversized { len: len as u64 });
            }
            proto::read_payload(&mut r, len, &mut buf)?;
            Ok(proto::decode(&buf)
                .map_or_else(|e: std::io::Error| Incoming::Undecodable(e.to_string()), Incoming::Request))
        });
        match read {
            Ok(h) => h,
            Err(e) => {
                tracing::debug!("process {who}: no hello ({e}); closing its connection");
                return;
            }
        }
    };
    let reply = hello_reply(&shared, &hello);
    if let Reply::Error(e) = &reply {
        shared.note_refusal(e);
    }
    let accepted = matches!(reply, Reply::Welcome(_));
    if send_answer(stream, &shared, &reply, &mut buf).is_err() || !accepted {
        return;
    }
    if stream.set_read_timeout(Some(limits.frame_timeout)).is_err() {
        return;
    }
    tracing::info!("process {who} (uid {}, gid {}) connected", ShowPid(peer.uid), ShowPid(peer.gid));
    let pidfd_raw =
        pidfd.as_ref().map(|f| f.as_raw_fd()).filter(|_| !crate::seeded::seeded("session-outlives-process"));
    let counted = SessionCount::new(shared.clone());
    let mut session = Session::new(shared.clone(), pid, pidfd);
    let mut writer = proto::NoSigPipe(stream);
    let mut out = Vec::new();
    let spin = next_request_spin();
    loop {
        if reader.buffer().is_empty() {
            match wait_next(stream.as_raw_fd(), pidfd_raw, spin) {
                Ok(Wake::Readable) => {}
                Ok(Wake::Gone) => {
                    tracing::info!("process {who} is gone: ending its session (another may still hold the socket)");
                    break;
                }
                Err(e) => {
                    tracing::warn!("process {who}: poll: {e}; closing its connection");
                    break;
                }
            }
        } else if let Some(fd) = pidfd_raw {
            // Requests already buffered (pipelined) are not served for a process that is gone.
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd (the session owns the pidfd for as long as this loop
            // runs), timeout 0: poll only reads and writes that struct.
            let n = unsafe { libc::poll(&mut p, 1, 0) };
            if n > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                tracing::info!("process {who} is gone: ending its session, its buffered requests unserved");
                break;
            }
        }
        let mut r = Deadline { inner: &mut reader, until: Instant::now() + limits.frame_timeout };
        let reply = match proto::read_request(&mut r, &mut buf, limits.frame_bytes) {
            Ok(Incoming::Request(req)) => {
                let one_way = req.is_one_way();
                let reply = session.run(req);
                if one_way {
                    None
                } else {
                    Some(reply)
                }
            }
            Ok(Incoming::Oversized { .. }) if crate::seeded::seeded("oversized-frame-closes") => break,
            Ok(Incoming::Oversized { len }) => Some(Reply::Error(WireError::LimitExceeded {
                limit: Limit::FrameBytes,
                asked: len,
                max: limits.frame_bytes as u64,
            })),
            Ok(Incoming::Undecodable(why)) => {
                Some(Reply::Error(WireError::Protocol(format!("a frame that is no request of this protocol: {why}"))))
            }
            Err(e) => {
                if e.kind() != std::io::ErrorKind::UnexpectedEof {
                    tracing::warn!("process {who}: {e}; closing its connection");
                }
                break;
            }
        };
        if buf.capacity() > KEEP_BUFFER {
            buf = Vec::new();
        }
        if let Some(reply) = reply {
            if let Reply::Error(e) = &reply {
                shared.note_refusal(e);
            }
            if let Err(e) = proto::write_frame(&mut writer, &reply, &mut out) {
                tracing::warn!("process {who}: sending a reply: {e}; closing its connection");
                break;
            }
            if out.capacity() > KEEP_BUFFER {
                out = Vec::new();
            }
        }
    }
    tracing::info!("process {who} disconnected");
    drop(session);
    drop(counted);
    // Whoever still holds the socket (a forked child) learns the session is over.
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

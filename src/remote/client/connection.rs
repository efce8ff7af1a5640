//! One connection to the tier daemon ([`Conn`]): a call at a time on one socket, the request's
//! bounds checked before anything is sent, a lost connection marked lost, and the plain calls
//! (counts, hints, stats, audits).

use crate::error::{Limit, TierError};
use crate::key::ContentKey;
use crate::remote::proto::{self, Reply, Request};
use std::io::{BufReader, Write};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::Duration;

/// How long a call waits for the daemon's reply before it gives the connection up.
pub(super) const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// Scratch buffer capacity a connection keeps between calls, bytes (a larger one, left by a big
/// request or reply, is freed after its call).
const KEEP_BUF_BYTES: usize = 1 << 20;

/// The request's variant name, for errors (formats only the first few bytes of its `Debug`
/// output, never a whole multi-megabyte key list).
pub(super) fn name(req: &Request) -> String {
    struct Head(String);
    impl std::fmt::Write for Head {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.0.push_str(s);
            if self.0.len() >= 24 {
                Err(std::fmt::Error)
            } else {
                Ok(())
            }
        }
    }
    let mut h = Head(String::new());
    let _ = std::fmt::Write::write_fmt(&mut h, format_args!("{req:?}"));
    let end = h.0.find([' ', '{', '(']).unwrap_or(h.0.len());
    h.0.truncate(end);
    h.0
}

/// The bounds a request is checked against before it is sent.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct RequestLimits {
    /// Largest request frame payload, bytes ([`Limit::FrameBytes`]).
    pub(super) frame_bytes: usize,
    /// Keys one query, save, hint or audit may name ([`Limit::KeysPerRequest`]).
    pub(super) keys_per_request: u64,
}

impl RequestLimits {
    /// The protocol's own bound: [`proto::MAX_FRAME`] bytes, keys bounded by the frame alone.
    #[cfg(test)]
    pub(super) const PROTOCOL: RequestLimits =
        RequestLimits { frame_bytes: proto::MAX_FRAME, keys_per_request: u64::MAX };

    /// The daemon's bounds as its welcome states them, never above the protocol's own.
    pub(super) fn of_daemon(w: &proto::WireLimits) -> RequestLimits {
        RequestLimits {
            frame_bytes: usize::try_from(w.frame_bytes).unwrap_or(usize::MAX).min(proto::MAX_FRAME),
            keys_per_request: w.keys_per_request,
        }
    }
}

/// Keys the request names (queries, saves, hints, audits).
fn key_count(req: &Request) -> Option<usize> {
    match req {
        Request::Query { keys, .. }
        | Request::PrepareSave { keys, .. }
        | Request::Hint { keys, .. }
        | Request::Audit { keys } => Some(keys.len()),
        _ => None,
    }
}

/// Refuses a request over `limits` before anything is encoded or sent (the size is computed
/// without allocating).
///
/// # Errors
/// [`TierError::LimitExceeded`] with [`Limit::KeysPerRequest`] (`asked`: keys) or
/// [`Limit::FrameBytes`] (`asked`: the payload's bytes); [`TierError::Protocol`] if the request
/// cannot be encoded at all.
fn check_request_size(req: &Request, limits: RequestLimits) -> Result<(), TierError> {
    if crate::seeded::seeded("client-sends-oversized") {
        return Ok(());
    }
    if let Some(n) = key_count(req) {
        if n as u64 > limits.keys_per_request {
            return Err(TierError::LimitExceeded {
                limit: Limit::KeysPerRequest,
                asked: n as u64,
                max: limits.keys_per_request,
            });
        }
    }
    let bytes = postcard::experimental::serialized_size(req)
        .map_err(|e| TierError::Protocol { reason: format!("encoding {}: {e}", name(req)) })?;
    if bytes > limits.frame_bytes {
        return Err(TierError::LimitExceeded {
            limit: Limit::FrameBytes,
            asked: bytes as u64,
            max: limits.frame_bytes as u64,
        });
    }
    Ok(())
}

pub(super) struct Io {
    pub(super) reader: BufReader<UnixStream>,
    pub(super) writer: UnixStream,
    pub(super) buf: Vec<u8>,
    /// Why the connection is unusable, once it is.
    pub(super) lost: Option<String>,
}

/// One connection to the tier daemon, shared by the tier handle, its ranks and its leases.
pub(crate) struct Conn {
    pub(super) io: Mutex<Io>,
    /// The daemon run this connection talks to (lease tokens carry it).
    pub(super) instance: u64,
    /// The process that connected (a forked child must connect again).
    pub(super) pid: u32,
    /// What a request may hold (checked before it is sent).
    pub(super) limits: RequestLimits,
}

pub(crate) fn lost(reason: impl Into<String>) -> TierError {
    TierError::Disconnected { reason: reason.into() }
}

pub(crate) fn unexpected(r: &Reply) -> TierError {
    lost(format!("the daemon sent an unexpected reply: {r:?}"))
}

pub(super) fn describe(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
            "the daemon closed the connection (it stopped or restarted)".into()
        }
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!("no reply from the daemon within {} s", REPLY_TIMEOUT.as_secs())
        }
        _ => e.to_string(),
    }
}

impl Conn {
    /// Fails with [`TierError::ForkedChild`] unless the calling process is the one that connected:
    /// a forked child shares the parent's socket, and a message from it would interleave with the
    /// parent's on one session. Nothing is sent.
    fn check_owner(&self) -> Result<(), TierError> {
        let current = std::process::id();
        if current != self.pid && !crate::seeded::seeded("forked-child-unchecked") {
            return Err(TierError::ForkedChild { owner: self.pid, current });
        }
        Ok(())
    }

    /// Sends `req` and, unless it is one-way, waits for its reply. A daemon error comes back as
    /// its [`TierError`] and leaves the connection usable; an I/O failure, or a reply that does not
    /// decode, marks the connection lost.
    ///
    /// Checked before anything is sent, leaving the connection usable: the calling process
    /// ([`TierError::ForkedChild`]) and the request's size ([`TierError::LimitExceeded`]:
    /// [`Limit::KeysPerRequest`] over the connection's key bound, [`Limit::FrameBytes`] over its
    /// frame bound, at most [`proto::MAX_FRAME`] bytes: a query, save, hint or audit of more than
    /// about 4.19 M keys).
    pub(crate) fn call(&self, req: &Request) -> Result<Reply, TierError> {
        self.check_owner()?;
        check_request_size(req, self.limits)?;
        let mut guard = self.io.lock().unwrap_or_else(|p| p.into_inner());
        let Io { reader, writer, buf, lost: why } = &mut *guard;
        if let Some(r) = why {
            return Err(lost(r.clone()));
        }
        // Encoding writes nothing to the socket: its failure is this request's alone.
        proto::encode(req, buf).map_err(|e| TierError::Protocol { reason: format!("encoding {}: {e}", name(req)) })?;
        let r = proto::NoSigPipe(writer).write_all(buf).and_then(|()| {
            if req.is_one_way() {
                Ok(Reply::Done)
            } else {
                // Most replies come within tens of microseconds: catch them spinning, as a copy's
                // wait does (`KVTIER_WAIT_SPIN_US`), rather than asleep in the read.
                if reader.buffer().is_empty() {
                    proto::spin_until_readable(reader.get_ref(), crate::sync::wait_spin());
                }
                proto::read_frame(reader, buf)
            }
        });
        // A reply frame of up to MAX_FRAME bytes is not worth keeping allocated.
        if buf.capacity() > KEEP_BUF_BYTES {
            *buf = Vec::new();
        }
        match r {
            Ok(Reply::Error(e)) => Err(e.into()),
            Ok(reply) => Ok(reply),
            Err(e) => {
                let reason = describe(&e);
                let _ = writer.shutdown(std::net::Shutdown::Both);
                *why = Some(reason.clone());
                Err(lost(reason))
            }
        }
    }

    /// [`Conn::call`] for a request whose reply is `Done`.
    pub(crate) fn expect_done(&self, req: &Request) -> Result<(), TierError> {
        match self.call(req)? {
            Reply::Done => Ok(()),
            r => Err(unexpected(&r)),
        }
    }

    pub(super) fn count(&self, req: &Request) -> Result<u64, TierError> {
        match self.call(req)? {
            Reply::Count(n) => Ok(n),
            r => Err(unexpected(&r)),
        }
    }

    pub(crate) fn attach(&self) -> Result<u32, TierError> {
        match self.call(&Request::Attach)? {
            Reply::Attached { rank } => Ok(rank),
            r => Err(unexpected(&r)),
        }
    }

    pub(crate) fn contains(&self, key: &ContentKey) -> Result<bool, TierError> {
        match self.call(&Request::Contains { key: *key })? {
            Reply::Bool(b) => Ok(b),
            r => Err(unexpected(&r)),
        }
    }

    pub(crate) fn evict(&self, n: usize) -> Result<usize, TierError> {
        self.count(&Request::Evict { blocks: n as u64 }).map(|n| n as usize)
    }

    pub(crate) fn hint(&self, keys: &[ContentKey], ttl: std::time::Duration) -> Result<u64, TierError> {
        let ttl_ms = ttl.as_millis().min(u64::MAX as u128) as u64;
        self.count(&Request::Hint { keys: keys.to_vec(), ttl_ms })
    }

    pub(crate) fn withdraw_hint(&self, id: u64) -> Result<bool, TierError> {
        match self.call(&Request::WithdrawHint { id })? {
            Reply::Bool(b) => Ok(b),
            r => Err(unexpected(&r)),
        }
    }

    pub(crate) fn live_hints(&self) -> Result<usize, TierError> {
        self.count(&Request::LiveHints).map(|n| n as usize)
    }

    pub(crate) fn expire_leases(&self) -> Result<usize, TierError> {
        self.count(&Request::ExpireLeases).map(|n| n as usize)
    }

    pub(crate) fn stats(&self) -> Result<proto::WireStats, TierError> {
        match self.call(&Request::Stats)? {
            Reply::Stats(s) => Ok(s),
            r => Err(unexpected(&r)),
        }
    }

    /// The daemon's SSD tier's counters (`None` without one).
    pub(crate) fn ssd_stats(&self) -> Result<Option<proto::WireSsdStats>, TierError> {
        match self.call(&Request::SsdStats)? {
            Reply::SsdStats(s) => Ok(s),
            r => Err(unexpected(&r)),
        }
    }

    /// The daemon's client processes but this connection's own.
    pub(crate) fn clients(&self) -> Result<Vec<proto::WireClient>, TierError> {
        match self.call(&Request::Clients)? {
            Reply::Clients(c) => Ok(c),
            r => Err(unexpected(&r)),
        }
    }

    /// The daemon's audit of its tier over `keys` (the inner `Err` names the first violated
    /// invariant).
    pub(crate) fn audit(&self, keys: &[ContentKey]) -> Result<Result<proto::WireAudit, String>, TierError> {
        match self.call(&Request::Audit { keys: keys.to_vec() })? {
            Reply::Audit(r) => Ok(r),
            r => Err(unexpected(&r)),
        }
    }
}

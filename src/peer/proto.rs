//! The peer control protocol: length-prefixed postcard frames (a 4-byte little-endian length,
//! then the payload), as the tier daemon's (`crate::remote::proto`), over TCP. The reader speaks
//! first with [`PeerRequest::Hello`]; every later request has exactly one reply. The hello is a
//! challenge-response over a shared secret (`super::auth`): nothing but a `Challenge` or a refusal
//! that says nothing about the owner is answered before the reader proved the secret.
//!
//! ```text
//!   reader                                   owner
//!   Hello {magic, version, nonce}          -> Challenge {nonce}
//!                                            | Refused (magic, version, connections)
//!   Auth {mac, ns, descriptor}             -> Welcome {mac, ns, block bytes, descriptor, limits}
//!                                            | Refused (auth; then namespace, descriptor)
//!   Query {keys, ttl_ms}                   -> Leased {lease, ttl_ms, [(key, offset, generation)]}
//!   (transport reads the blocks)
//!   Validate {lease, blocks}               -> Valid [still valid per block read]
//!   Release {lease}                        -> Released (true if it was live)
//! ```

use crate::key::{ContentKey, Namespace};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;

/// First bytes of a hello: "kvtier peer".
pub const PEER_MAGIC: [u8; 4] = *b"KVTP";
/// Version of this protocol; a hello with another is refused ([`PeerRefusal::Version`]).
/// Version 2: the hello is a challenge-response over the peers' shared secret.
pub const PEER_PROTOCOL_VERSION: u32 = 2;

/// Bytes of a nonce and of a MAC in the hello.
pub use super::auth::NONCE_BYTES;

/// A request from a reader to an owner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerRequest {
    /// The first frame: [`PEER_MAGIC`], [`PEER_PROTOCOL_VERSION`] and the reader's nonce (32
    /// random bytes of this connection). Answered [`PeerReply::Challenge`].
    Hello {
        /// [`PEER_MAGIC`].
        magic: [u8; 4],
        /// [`PEER_PROTOCOL_VERSION`].
        version: u32,
        /// The reader's nonce.
        nonce: [u8; NONCE_BYTES],
    },
    /// The second frame: the reader's proof of the secret (its MAC over both nonces, its
    /// namespace and its descriptor: `super::auth`), the namespace its keys are in, and its
    /// transport descriptor ([`super::PeerTransport::local_descriptor`]).
    Auth {
        /// HMAC-SHA-256 of the reader (`super::auth::mac`).
        mac: [u8; NONCE_BYTES],
        /// The reader's tier's namespace.
        namespace: Namespace,
        /// The reader's transport descriptor (opaque bytes).
        descriptor: Vec<u8>,
    },
    /// Pin the longest ready prefix of `keys` under a lease that lives `ttl_ms` milliseconds
    /// (capped at the owner's [`super::PeerLimits::max_lease_ttl`]).
    Query {
        /// Content keys, in prompt order.
        keys: Vec<ContentKey>,
        /// Requested lease time-to-live, ms.
        ttl_ms: u64,
    },
    /// Whether each block of lease `lease` is still valid: its slot holds its key at its
    /// generation and the lease has not expired.
    Validate {
        /// A lease id from [`PeerReply::Leased`].
        lease: u64,
        /// How many of the lease's leading blocks the reader read (only those are validated, and
        /// count as fetched for [`super::PeerServer::hold`]).
        blocks: u64,
    },
    /// Settles lease `lease` (its pins drop).
    Release {
        /// A lease id from [`PeerReply::Leased`].
        lease: u64,
    },
}

/// One block an owner leased: where its bytes are and at which generation.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WirePeerBlock {
    /// The block's content key.
    pub key: ContentKey,
    /// Byte offset of its slot from the owner's pool base.
    pub offset: u64,
    /// The slot's generation when pinned.
    pub generation: u64,
}

/// The bounds an owner holds a connection to (sent in the welcome).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WirePeerLimits {
    /// Largest request frame payload, bytes.
    pub frame_bytes: u64,
    /// Keys one query may name.
    pub keys_per_query: u64,
    /// Leases one connection may hold at once.
    pub leases_per_connection: u64,
    /// Longest lease time-to-live, ms.
    pub max_lease_ttl_ms: u64,
    /// Longest idle time between requests before the owner closes the connection, ms.
    pub idle_timeout_ms: u64,
}

/// Why an owner refused a hello or a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerRefusal {
    /// The hello did not start with [`PEER_MAGIC`].
    Magic,
    /// The reader speaks another protocol version.
    Version {
        /// The owner's version.
        ours: u32,
        /// The reader's.
        theirs: u32,
    },
    /// The reader's proof of the secret failed (another secret, none, a replayed hello). Says
    /// nothing about the owner; the connection is closed.
    Auth,
    /// The owner serves as many connections as its limit allows: try again later (the connection
    /// is closed). Sent before the hello.
    Connections {
        /// The limit.
        max: u64,
    },
    /// The reader's namespace is not the owner's (sent only to a reader that proved the secret).
    Namespace {
        /// The owner's namespace.
        ours: Namespace,
    },
    /// The reader's transport descriptor could not be loaded (the transport's message).
    Descriptor(String),
    /// A request over a limit: which, what was asked, the bound.
    Limit {
        /// The limit's name.
        what: String,
        /// What the request asked.
        asked: u64,
        /// The bound.
        max: u64,
    },
    /// A request before the hello is complete, or a second hello.
    OutOfOrder,
}

/// A reply from an owner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerReply {
    /// The answer to a hello: the owner's nonce (32 random bytes of this connection).
    Challenge {
        /// The owner's nonce.
        nonce: [u8; NONCE_BYTES],
    },
    /// The reader's proof checked: the owner's own proof and what a reader needs.
    Welcome {
        /// HMAC-SHA-256 of the owner over both nonces, its namespace, its block bytes and its
        /// descriptor (`super::auth::mac`); the reader checks it before it loads the descriptor.
        mac: [u8; NONCE_BYTES],
        /// The owner's namespace.
        namespace: Namespace,
        /// Bytes per block (the geometry's slot bytes; one transport read each).
        block_bytes: u64,
        /// The owner's transport descriptor.
        descriptor: Vec<u8>,
        /// The owner's bounds.
        limits: WirePeerLimits,
    },
    /// A hello or request refused (after a refused hello the owner closes the connection).
    Refused(PeerRefusal),
    /// A query's lease: `lease` 0 when no leading block was ready (nothing to release).
    Leased {
        /// Lease id (0: empty lease).
        lease: u64,
        /// The lease's time-to-live as granted, ms.
        ttl_ms: u64,
        /// The leased blocks, the longest ready prefix of the query's keys.
        blocks: Vec<WirePeerBlock>,
    },
    /// Per block validated, still valid; empty for a lease that is unknown, released or expired.
    Valid(Vec<bool>),
    /// True if the release settled a live lease.
    Released(bool),
}

/// Writes `msg` as one frame (`buf` is scratch space).
///
/// # Errors
/// Encoding or I/O errors.
pub fn write_msg<T: Serialize>(w: &mut impl Write, msg: &T, buf: &mut Vec<u8>) -> std::io::Result<()> {
    crate::remote::proto::write_frame(w, msg, buf)
}

/// What [`read_msg`] read.
#[derive(Debug)]
pub enum Frame<T> {
    /// A message.
    Msg(T),
    /// A frame over `max_frame` bytes (its announced length, bytes); the stream is no longer in
    /// step, so the connection must be closed.
    Oversized(u64),
    /// A frame within the bound that does not decode (the reason).
    Undecodable(String),
}

/// Reads one frame of at most `max_frame` payload bytes. Memory: at most `max_frame` bytes (plus
/// 64 KiB) whatever the length prefix says; an oversized frame is not read.
///
/// # Errors
/// I/O errors ([`std::io::ErrorKind::UnexpectedEof`] at end of stream, also mid-frame).
pub fn read_msg<T: for<'de> Deserialize<'de>>(
    r: &mut impl Read,
    buf: &mut Vec<u8>,
    max_frame: usize,
) -> std::io::Result<Frame<T>> {
    let len = crate::remote::proto::read_len(r)?;
    if len > max_frame {
        return Ok(Frame::Oversized(len as u64));
    }
    crate::remote::proto::read_payload(r, len, buf)?;
    Ok(match crate::remote::proto::decode(buf) {
        Ok(m) => Frame::Msg(m),
        Err(e) => Frame::Undecodable(e.to_string()),
    })
}

/// A stream whose every read and write must end by `deadline`: each socket call gets what is left
/// of it as its timeout (never the whole time again), and once it has passed a call fails with
/// [`std::io::ErrorKind::TimedOut`] without touching the socket. So a frame or a hello that
/// arrives a byte at a time still ends at the deadline.
pub(crate) struct Timed<'a> {
    /// The socket.
    pub(crate) stream: &'a TcpStream,
    /// When every call must have ended.
    pub(crate) deadline: Instant,
}

impl Timed<'_> {
    fn left(&self) -> std::io::Result<std::time::Duration> {
        // Seeded bug (tests only): `peer-deadline-per-read` gives each call the whole timeout
        // again (the old behaviour: a trickled frame took as long as the sender liked).
        if crate::seeded::seeded("peer-deadline-per-read") {
            return Ok(std::time::Duration::from_secs(30));
        }
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the deadline passed"));
        }
        Ok(left)
    }
}

impl Read for Timed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        (&mut &*self.stream).read(buf)
    }
}

impl Write for Timed<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        (&mut &*self.stream).write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

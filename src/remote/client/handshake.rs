//! The connect handshake ([`connect`]): the socket, the peer's uid, the hello, the pool's memfd
//! and the daemon's welcome (its geometry, pool and policy), with [`ConnectOptions`].

use super::connection::{describe, lost, unexpected, Conn, Io, RequestLimits, REPLY_TIMEOUT};
use crate::error::{Error, TierError};
use crate::evict::PolicyKind;
use crate::geometry::{ArenaSpec, Geometry, Placement};
use crate::remote::proto::{self, Reply, Request};
use crate::slab::pool::{Backing, HostPool, SharedPoolLayout};
use std::io::{BufReader, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Mutex;

/// Receives the marker byte and, with it, the pool's memfd (if any).
fn recv_marker(stream: &UnixStream) -> std::io::Result<(u8, Option<OwnedFd>)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut byte = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 2]);
    let msg = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(std::io::Error::from)?;
    let mut fd = None;
    for c in msg.cmsgs().map_err(std::io::Error::from)? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            for raw in fds {
                // SAFETY: the kernel installed `raw` in this process for this message; nothing
                // else owns it. Extra fds (none are sent) are closed by their OwnedFd.
                let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                fd.get_or_insert(owned);
            }
        }
    }
    if msg.bytes == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok((byte[0], fd))
}

fn geometry_of(w: &proto::Welcome) -> Result<Geometry, TierError> {
    let arenas = w
        .arenas
        .iter()
        .map(|a| ArenaSpec {
            name: a.name.clone(),
            bytes_per_page: a.bytes_per_page,
            page_stride: a.page_stride,
            pages: a.pages,
            placement: match a.fused {
                Some((buffer, offset)) => Placement::Fused { buffer, offset },
                None => Placement::Own,
            },
        })
        .collect();
    let bad = |e: &dyn std::fmt::Display| lost(format!("the daemon's geometry is invalid here: {e}"));
    let mut g = Geometry::new(&w.model, w.page_tokens, arenas).map_err(|e| bad(&e))?;
    if let Some((i, n)) = w.shard {
        g = g.with_shard(i, n).map_err(|e| bad(&e))?;
    }
    if g.namespace() != w.namespace || g.slot_bytes() != w.slot_bytes {
        return Err(lost("the daemon's geometry does not derive its namespace and slot size here"));
    }
    Ok(g)
}

/// How [`crate::HostTier::connect_with`] connects: the namespace to check and the uid the daemon must
/// run as.
///
/// ```
/// # use kvtier::ConnectOptions;
/// // A daemon run by the service account with uid 990 (engines in its group reach the socket).
/// let opts = ConnectOptions::new().expected_uid(990);
/// # let _ = opts;
/// ```
#[derive(Clone, Debug, Default)]
pub struct ConnectOptions {
    geometry: Option<Geometry>,
    expected_uid: Option<u32>,
}

impl ConnectOptions {
    /// The defaults: adopt the daemon's geometry; trust a daemon running as this process's
    /// effective uid, or as root.
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks that the daemon serves `geometry`'s namespace (model, page size, arenas and shard),
    /// as [`crate::HostTier::connect_as`] does.
    pub fn geometry(mut self, geometry: &Geometry) -> Self {
        self.geometry = Some(geometry.clone());
        self
    }

    /// Trusts a daemon running as `uid` (or as root) instead of one running as this process's
    /// effective uid: for a daemon run by a service account whose socket engines reach through
    /// its group.
    pub fn expected_uid(mut self, uid: u32) -> Self {
        self.expected_uid = Some(uid);
        self
    }

    /// The uid the daemon must run as: the one configured, else this process's effective uid.
    pub fn trusted_uid(&self) -> u32 {
        // SAFETY: geteuid has no preconditions and cannot fail.
        self.expected_uid.unwrap_or_else(|| unsafe { libc::geteuid() })
    }
}

/// Refuses a socket whose peer (the process that listens on it, `SO_PEERCRED`) runs as neither
/// `expected` nor root: a process of another uid that took the socket's path would otherwise
/// receive the hello's namespace and every later request's keys. Root is always trusted: it can
/// read any process's memory anyway.
///
/// # Errors
/// [`TierError::UntrustedDaemon`]; [`TierError::Disconnected`] if the credentials cannot be read.
fn check_peer(stream: &UnixStream, expected: u32) -> Result<(), TierError> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let cred = getsockopt(stream, PeerCredentials)
        .map_err(|e| lost(format!("reading the tier daemon's credentials (SO_PEERCRED): {e}")))?;
    let found = cred.uid();
    if found != expected && found != 0 && !crate::seeded::seeded("daemon-uid-unchecked") {
        return Err(TierError::UntrustedDaemon { expected, found });
    }
    Ok(())
}

/// Sets `FD_CLOEXEC` on `fd` (the standard library already opens sockets with `SOCK_CLOEXEC`;
/// this keeps it so whatever opened them): an `exec`'d program never inherits the session.
fn keep_cloexec(fd: &impl AsRawFd) -> std::io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    let flags = FdFlag::from_bits_retain(fcntl(fd.as_raw_fd(), FcntlArg::F_GETFD)?);
    if !flags.contains(FdFlag::FD_CLOEXEC) {
        fcntl(fd.as_raw_fd(), FcntlArg::F_SETFD(flags | FdFlag::FD_CLOEXEC))?;
    }
    Ok(())
}

/// A connection made ([`connect`]): the connection, and the daemon's geometry, pool (mapped here)
/// and policy.
pub(crate) struct Connected {
    pub(crate) conn: Conn,
    pub(crate) geometry: Geometry,
    pub(crate) pool: HostPool,
    pub(crate) policy: PolicyKind,
}

/// Why a connect to `path` failed, for [`TierError::Disconnected`]'s reason. Where nothing
/// listens there (no socket file, `ENOENT`, or a stale one, `ECONNREFUSED`), no daemon ever ran or
/// it stopped: the reason says so and how to start `kvtierd` on that path.
fn connect_failure(path: &Path, e: &std::io::Error) -> String {
    use std::io::ErrorKind;
    if !matches!(e.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused) {
        return format!("connecting to the tier daemon at {}: {e}", path.display());
    }
    let socket = if path == crate::remote::default_socket_path() {
        String::new()
    } else {
        format!(" --socket {}", path.display())
    };
    format!(
        "nothing listens at {} ({e}): no tier daemon runs there; start one with \
         `kvtierd --geometry PRESET --pool SIZE{socket}` (from a source checkout: \
         `cargo run --release -p kvtierd -- --geometry PRESET --pool SIZE{socket}`)",
        path.display()
    )
}

/// Connects to the tier daemon at `path` (see [`crate::HostTier::connect`]).
///
/// # Errors
/// As [`crate::HostTier::connect`].
pub(crate) fn connect(path: &Path, opts: &ConnectOptions) -> Result<Connected, Error> {
    let expect = opts.geometry.as_ref();
    let stream = UnixStream::connect(path).map_err(|e| lost(connect_failure(path, &e)))?;
    let io_err = |e: std::io::Error| Error::Tier(lost(describe(&e)));
    keep_cloexec(&stream).map_err(io_err)?;
    check_peer(&stream, opts.trusted_uid())?;
    stream.set_read_timeout(Some(REPLY_TIMEOUT)).map_err(io_err)?;
    let mut buf = Vec::new();
    let hello = Request::Hello {
        magic: proto::MAGIC,
        version: proto::PROTOCOL_VERSION,
        namespace: expect.map(|g| g.namespace()),
    };
    proto::write_frame(&mut proto::NoSigPipe(&stream), &hello, &mut buf).map_err(io_err)?;
    let (marker, fd) = recv_marker(&stream).map_err(io_err)?;
    let reader_stream = stream.try_clone().map_err(io_err)?;
    keep_cloexec(&reader_stream).map_err(io_err)?;
    let mut reader = BufReader::new(reader_stream);
    let reply: Reply = proto::read_frame(&mut reader, &mut buf).map_err(io_err)?;
    let welcome = match (marker, reply, fd) {
        (proto::MARKER_POOL, Reply::Welcome(w), Some(fd)) => (w, fd),
        // A refusal of the hello that names no typed reason (the daemon could not start the
        // connection's thread, say): there is no connection, so it is `Disconnected`, not `Protocol`.
        (_, Reply::Error(proto::WireError::Other(m)), _) => {
            return Err(Error::Tier(TierError::Disconnected {
                reason: format!("the daemon refused the connection: {m}"),
            }))
        }
        (_, Reply::Error(e), _) => return Err(Error::Tier(e.into())),
        (_, r, _) => return Err(Error::Tier(unexpected(&r))),
    };
    let (w, fd) = welcome;
    if w.version != proto::PROTOCOL_VERSION {
        return Err(Error::Tier(TierError::ProtocolMismatch { daemon: w.version, client: proto::PROTOCOL_VERSION }));
    }
    let geometry = geometry_of(&w)?;
    let backing = match w.backing.as_str() {
        "hugetlb" => Backing::HugeTlb,
        "thp" => Backing::TransparentHuge,
        _ => Backing::Plain,
    };
    let layout =
        SharedPoolLayout { slot_bytes: w.slot_bytes, capacity: w.capacity, mapped_bytes: w.mapped_bytes, backing };
    let pool = HostPool::attach_shared(fd, layout)?;
    let policy = w.policy.parse::<PolicyKind>().unwrap_or_default();
    let conn = Conn {
        io: Mutex::new(Io { reader, writer: stream, buf, lost: None }),
        instance: w.instance,
        pid: std::process::id(),
        limits: RequestLimits::of_daemon(&w.limits),
    };
    Ok(Connected { conn, geometry, pool, policy })
}

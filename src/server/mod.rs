//! The daemon side: serves one [`HostTier`] (with its pool in shared memory) to engine processes.
//!
//! One thread per connection runs the requests of `crate::remote::proto` against the tier with the same
//! code an in-process rank runs: [`HostTier::query_shared`] for queries, the save preparation
//! shared with [`crate::Rank::save_with`], and [`Lease`](crate::Lease)'s restore hold, exactly as
//! [`crate::Rank::restore`] takes it. What a connection holds is its own:
//!
//! - **lease handles**: a lease lives while any connection holds a handle on it (the one that
//!   queried, and every one that opened its token); the last handle dropped settles it. Lease ids
//!   are random 64-bit numbers, so a connection can only name a lease it was given (a token);
//! - **saves in flight**: `WRITING` slots reserved for the connection's copy, until it finishes
//!   them;
//! - **restores in flight**: the pins (and, until submitted, the use) of the connection's copy;
//! - **hints**: withdrawn when the connection ends.
//!
//! Every one of these is bounded per connection ([`Limits`]), and so is what a connection makes
//! the daemon hold while it reads (a frame's buffer grows only as its bytes arrive, up to
//! [`Limits::frame_bytes`]); the number of connections is bounded too, in all and per process. A
//! request over a bound is answered [`WireError::LimitExceeded`] and does nothing; the connection
//! stays usable.
//!
//! **A session ends the same way however it ends**: the client closed the socket, a read or write
//! failed or timed out, the process that said hello is gone (the daemon watches its pidfd, so a
//! forked child that still holds the socket does not keep the session alive), or the connection's
//! thread unwound: the session's `Drop` does what its close does. Each request runs under
//! `catch_unwind`: a panic fails that request with [`WireError::Panicked`] and the session's state
//! stays as it was before the request (every map entry changes only after the work that can fail).
//!
//! **A dying engine loses nothing for the others.** When a session ends, its lease handles are
//! dropped at once (its leases settle unless another process holds them) and its hints are
//! withdrawn. Its saves in flight lose their index entries at once (the keys can be saved by
//! others; the half-written blocks were never visible) but their slots stay `WRITING`, and its
//! restores keep their pins, until the **process is gone**: the daemon holds a pidfd of each peer
//! (from `SO_PEERPIDFD`, or `pidfd_open` of the `SO_PEERCRED` pid) and a reaper thread returns the
//! slots to the free list (with a new generation) and drops the pins once it reports the exit,
//! since a copy may run as long as its process does. Without a pidfd they stay withheld for good.
//! Copies whose outcome a rank reported unknown (its backend panicked) are withheld the same way.

mod clients;
mod connection;
mod drive;
mod limits;
#[cfg(feature = "metrics")]
mod metrics;
mod peer;
mod session;
mod shared;
mod socket;
#[cfg(test)]
mod tests;

pub use drive::drive_session;
pub use limits::{Limits, ServerConfig};

use crate::error::{Error, Limit};
use crate::remote::proto::{Reply, Request, WireError};
use crate::tier::HostTier;
use connection::{send_answer, serve};
use peer::{exited, peer_pid};
use shared::{ConnSlot, Parked, Shared};
use socket::{bind_socket, clear_stale_socket, lock_bind, remove_lock_file, socket_dir};
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the reaper looks for exited processes and closes refused connections.
const REAP_EVERY: Duration = Duration::from_millis(20);
/// How long a refused connection is kept open (its hello drained) so the refusal reaches it.
const REFUSED_LINGER: Duration = Duration::from_secs(1);
/// Refused connections kept lingering at once; beyond this they are closed at once.
const MAX_REFUSED: usize = 64;

/// The tier daemon's server: a [`HostTier`] with its pool in shared memory, a Unix socket, and a
/// thread per connected engine process. See the module docs and `docs/design.md`.
pub struct Server {
    listener: UnixListener,
    shared: Arc<Shared>,
    path: PathBuf,
}

impl Server {
    /// [`Server::bind_with`] with the default [`ServerConfig`] (default [`Limits`], socket `0600`).
    ///
    /// # Errors
    /// As [`Server::bind_with`].
    pub fn bind(path: impl AsRef<Path>, tier: HostTier) -> Result<Server, Error> {
        Self::bind_with(path, tier, ServerConfig::default())
    }

    /// Listens on the Unix socket `path` for engines and serves `tier` to them, holding every
    /// connection to `config.limits`. The socket's directory is created if missing (`0700`); a
    /// socket left at `path` by a daemon that is gone is replaced; anything else at `path` (a
    /// regular file, a directory, a socket a live daemon listens on) is an error and is left
    /// alone. The socket is `0600` (`0660` of `config.group` with a group), and never more open
    /// than `0600` before its mode is set (it is bound under umask `0177`, the process's umask
    /// restored after). Probing, replacing and binding the socket happen under an exclusive
    /// `flock` of the file `PATH.lock` beside it (created `0600`; [`Server::remove_lock_file`] removes it
    /// on a clean stop), so of two
    /// daemons starting at once on one path the second waits and then finds the first listening.
    ///
    /// # Errors
    /// [`Error::PrivatePool`] if `tier`'s pool is not in shared memory (make it with
    /// [`HostTier::new_shared`]); [`Error::ServeConnected`] if `tier` is itself a connected tier;
    /// [`Error::Limits`] if the limits are invalid (a zero bound, a
    /// frame bound above the protocol's `MAX_FRAME`); [`Error::DaemonRunning`],
    /// [`Error::SocketPathTaken`] or [`Error::SocketUnprobed`] if something other than a stale
    /// socket is at `path`; [`Error::UnsafeSocketDir`] if the per-user directory in `/tmp` is not
    /// ours; [`Error::Io`] if the directory cannot be made, `PATH.lock` cannot be opened or
    /// locked, or the socket cannot be bound or given its mode; [`Error::Chown`] if the socket
    /// or its directory cannot be given to `config.group`.
    pub fn bind_with(path: impl AsRef<Path>, tier: HostTier, config: ServerConfig) -> Result<Server, Error> {
        let path = path.as_ref().to_path_buf();
        if tier.is_connected_tier() && !crate::seeded::seeded("serve-connected") {
            return Err(Error::ServeConnected);
        }
        if tier.pool().shared_fd().is_none() {
            return Err(Error::PrivatePool);
        }
        config.limits.check()?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            socket_dir(dir, config.group)?;
        }
        // Held until the socket has its mode: another daemon's probe waits for it.
        let _lock = lock_bind(&path)?;
        clear_stale_socket(&path)?;
        let listener = bind_socket(&path)?;
        let mode = if let Some(gid) = config.group {
            std::os::unix::fs::chown(&path, None, Some(gid)).map_err(|source| Error::Chown {
                path: path.clone(),
                gid,
                source,
            })?;
            0o660
        } else {
            0o600
        };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).map_err(|source| Error::Io {
            what: if mode == 0o660 { "setting mode 0660 on the socket" } else { "setting mode 0600 on the socket" },
            path: path.clone(),
            source,
        })?;
        let shared = Arc::new(Shared::new(tier, config.limits));
        Ok(Server { listener, shared, path })
    }

    /// Makes this daemon a peer reader: a client's query whose local prefix (host pool, then SSD
    /// tier) ends short asks `peers` for the keys after it ([`crate::PeerSet::query_shared`]),
    /// each peer's steps bounded by `timeout` from the query's start. Blocks a peer brings are
    /// published in this daemon's pool (the next query hits locally) and the client's lease says
    /// so per block ([`crate::Lease::source`] is [`crate::BlockSource::Peer`]). A peer that fails
    /// is logged and skipped: the client gets the prefix held so far, as without peers. Call it
    /// before [`Server::run`]; the session threads of later connections read it.
    ///
    /// # Errors
    /// [`crate::PeerError::Config`] if `peers` fills another tier's pool than this server's, if
    /// `timeout` is zero or over an hour, or if peers were already set.
    #[cfg(feature = "peers")]
    #[cfg_attr(docsrs, doc(cfg(feature = "peers")))]
    pub fn fetch_from_peers(&self, peers: Arc<crate::PeerSet>, timeout: Duration) -> Result<(), crate::PeerError> {
        let same = match (peers.tier().in_process_core(), self.shared.tier.in_process_core()) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        if !same {
            return Err(crate::PeerError::Config("the peer set fills another tier's pool than this server's".into()));
        }
        if timeout.is_zero() || timeout > Duration::from_secs(3600) {
            return Err(crate::PeerError::Config("the peer timeout must be > 0 and at most 1 hour".into()));
        }
        self.shared
            .peers
            .set((peers, timeout))
            .map_err(|_| crate::PeerError::Config("this server already reads from peers".into()))
    }

    /// The tier served.
    pub fn tier(&self) -> &HostTier {
        &self.shared.tier
    }

    /// On a clean stop, after the socket at `path` is removed: removes `PATH.lock`, the bind
    /// lock's file, if no daemon holds the lock now (one binding `path` after this one keeps it).
    /// Removal is safe against the race the lock prevents: a daemon that takes the lock checks that
    /// `PATH.lock` still names the file it locked, and otherwise locks the new one. True if removed.
    pub fn remove_lock_file(path: impl AsRef<Path>) -> bool {
        remove_lock_file(path.as_ref())
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The random number naming this run of the daemon (in every lease token).
    pub fn instance(&self) -> u64 {
        self.shared.welcome.instance
    }

    /// The bounds every connection is held to.
    pub fn limits(&self) -> &Limits {
        &self.shared.limits
    }

    /// Tests only: every request for which `hook` returns true panics inside the daemon's request
    /// handling (where a bug in the tier would), so a test can check what a panic leaves behind.
    /// Set once, before [`Server::run`]; later calls are ignored.
    #[doc(hidden)]
    pub fn panic_on_requests(&self, hook: impl Fn(&Request) -> bool + Send + Sync + 'static) {
        let _ = self.shared.panic_hook.set(Box::new(hook));
    }

    /// Serves connections until accepting fails for good (blocking): a thread per connection, and
    /// a reaper thread that releases what dead processes' copies held. A connection over
    /// [`Limits::connections`], or one whose thread cannot start, is refused with a typed error
    /// and closed; the daemon goes on.
    ///
    /// # Errors
    /// Starting the reaper thread.
    pub fn run(&self) -> std::io::Result<()> {
        let reaper = self.shared.clone();
        std::thread::Builder::new().name("kvtierd-reaper".into()).spawn(move || reap(&reaper))?;
        let limits = self.shared.limits;
        let mut n = 0u64;
        for stream in self.listener.incoming() {
            let stream = match stream {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE, ENOMEM, ECONNABORTED: this connection is lost, the next may work.
                    tracing::warn!("accept: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            n += 1;
            self.shared.accepted.fetch_add(1, Ordering::Relaxed);
            let live = self.shared.live.fetch_add(1, Ordering::AcqRel) + 1;
            let mut slot = ConnSlot::new(self.shared.clone());
            let stream = Arc::new(stream);
            if live > limits.connections && !crate::seeded::seeded("no-connection-limit") {
                tracing::warn!("refusing a connection: {} are open, the limit is {}", live - 1, limits.connections);
                refuse(&self.shared, stream, over(Limit::Connections, live, limits.connections));
                drop(slot);
                continue;
            }
            if let Some(pid) = peer_pid(&stream) {
                if let Err(asked) = slot.count_process(pid) {
                    tracing::warn!(
                        "refusing a connection of process {pid}: it has {} open, the limit is {}",
                        asked - 1,
                        limits.connections_per_process
                    );
                    refuse(
                        &self.shared,
                        stream,
                        over(Limit::ConnectionsPerProcess, asked, limits.connections_per_process),
                    );
                    drop(slot);
                    continue;
                }
            }
            let shared = self.shared.clone();
            let s = stream.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("kvtierd-conn-{n}"))
                .stack_size(limits.thread_stack_bytes)
                .spawn(move || serve(shared, &s, slot));
            if let Err(e) = spawned {
                if crate::seeded::seeded("spawn-failure-stops-daemon") {
                    return Err(e);
                }
                tracing::warn!("refusing a connection: its thread cannot start: {e}");
                let e = WireError::Other(format!("the daemon could not start a thread for this connection: {e}"));
                refuse(&self.shared, stream, e);
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("path", &self.path).field("instance", &self.instance()).finish()
    }
}

/// Sends a refusal (marker and error frame) without blocking and keeps the connection open a
/// moment ([`REFUSED_LINGER`], the reaper drains its hello) so the client reads the refusal rather
/// than a reset.
/// The answer to a connection over `limit`: `asked` of at most `max`.
fn over(limit: Limit, asked: usize, max: usize) -> WireError {
    WireError::LimitExceeded { limit, asked: asked as u64, max: max as u64 }
}

fn refuse(shared: &Shared, stream: Arc<UnixStream>, e: WireError) {
    shared.note_refusal(&e);
    if stream.set_nonblocking(true).is_err() {
        return;
    }
    let mut buf = Vec::new();
    if send_answer(&stream, shared, &Reply::Error(e), &mut buf).is_err() {
        return;
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut refused = shared.refused.lock().unwrap_or_else(|p| p.into_inner());
    if refused.len() < MAX_REFUSED {
        refused.push((stream, Instant::now()));
    }
}

/// Releases parked slots and pins of processes that have exited; closes refused connections.
fn reap(shared: &Shared) {
    let mut scratch = [0u8; 4096];
    loop {
        std::thread::sleep(REAP_EVERY);
        let done: Vec<Parked> = {
            let mut parked = shared.parked.lock().unwrap_or_else(|p| p.into_inner());
            let (gone, alive) =
                std::mem::take(&mut *parked).into_iter().partition(|p| p.pidfd.as_ref().is_some_and(exited));
            *parked = alive;
            gone
        };
        for p in done {
            shared.release_parked(p);
        }
        let mut refused = shared.refused.lock().unwrap_or_else(|p| p.into_inner());
        refused.retain(|(s, since)| {
            // Drain what the client sent (its hello), so closing does not reset the connection.
            let eof = loop {
                match (&**s).read(&mut scratch) {
                    Ok(0) => break true,
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => break e.kind() != std::io::ErrorKind::WouldBlock,
                }
            };
            !eof && since.elapsed() < REFUSED_LINGER
        });
    }
}

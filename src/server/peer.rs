//! Who is at the other end of a connection: the credentials of the process that connected
//! (`SO_PEERCRED`), a pidfd of that process, and whether it has exited.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// True once the process behind `pidfd` has exited.
pub(super) fn exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, timeout 0: poll only reads and writes that struct.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
}

/// A process id (or uid, gid) in a log line: the number, or `unknown` where the kernel gave none.
#[derive(Copy, Clone)]
pub(super) struct ShowPid(pub(super) Option<u32>);

impl std::fmt::Display for ShowPid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(p) => write!(f, "{p}"),
            None => f.write_str("unknown"),
        }
    }
}

/// What the peer of a connection is.
#[derive(Copy, Clone, Debug)]
pub(super) struct Peer {
    pub(super) pid: Option<u32>,
    pub(super) uid: Option<u32>,
    pub(super) gid: Option<u32>,
}

/// The pid of the process that connected (`SO_PEERCRED`), if the kernel names one.
pub(super) fn peer_pid(stream: &UnixStream) -> Option<u32> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    getsockopt(stream, PeerCredentials).ok().map(|c| c.pid()).filter(|&p| p > 0).map(|p| p as u32)
}

/// The peer's credentials (`SO_PEERCRED`: the process that connected) and a pidfd of that process
/// (`SO_PEERPIDFD`, Linux 6.5; else `pidfd_open`, Linux 5.3).
pub(super) fn peer_process(stream: &UnixStream) -> (Peer, Option<OwnedFd>) {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let cred = getsockopt(stream, PeerCredentials).ok();
    let pid = cred.map(|c| c.pid()).filter(|&p| p > 0);
    let peer = Peer { pid: pid.map(|p| p as u32), uid: cred.map(|c| c.uid()), gid: cred.map(|c| c.gid()) };
    // SO_PEERPIDFD is 77 in the generic socket option table (x86-64, arm64); elsewhere only
    // pidfd_open is tried.
    let (rc, fd) = if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
        const SO_PEERPIDFD: libc::c_int = 77;
        let mut fd: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `fd`, a live c_int.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PEERPIDFD,
                (&mut fd as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        (rc, fd)
    } else {
        (-1, -1)
    };
    if rc == 0 && fd >= 0 {
        // SAFETY: the kernel made `fd` for us; nothing else owns it.
        return (peer, Some(unsafe { OwnedFd::from_raw_fd(fd) }));
    }
    let Some(pid) = pid else { return (peer, None) };
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return (peer, None);
    }
    // SAFETY: as above, a new fd owned by nobody else.
    (peer, Some(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
}

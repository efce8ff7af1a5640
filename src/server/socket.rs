//! The daemon's socket on disk: its directory's checks, a stale socket's removal, the bind lock
//! (`PATH.lock`) and the bind under a private umask.

use crate::error::Error;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The euid of this process.
fn euid() -> u32 {
    // SAFETY: geteuid takes nothing and cannot fail.
    unsafe { libc::geteuid() }
}

/// Makes sure `dir` (the socket's directory) exists; creates it (`0700`, or `0750` of `group`) if
/// it does not. The per-user fallback directory in `/tmp` (see [`crate::remote::default_socket_path`])
/// must be a directory of ours that nobody else can write, or another user could have made it.
pub(super) fn socket_dir(dir: &Path, group: Option<u32>) -> Result<(), Error> {
    let io = |what: &'static str| move |source| Error::Io { what, path: dir.to_path_buf(), source };
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .mode(if group.is_some() { 0o750 } else { 0o700 })
                .create(dir)
                .map_err(io("creating the socket's directory"))?;
            if let Some(gid) = group {
                std::os::unix::fs::chown(dir, None, Some(gid)).map_err(|source| Error::Chown {
                    path: dir.to_path_buf(),
                    gid,
                    source,
                })?;
            }
            Ok(())
        }
        Err(e) => Err(io("reading the socket's directory")(e)),
        Ok(m) => {
            if crate::remote::is_per_user_tmp_dir(dir) && (!m.is_dir() || m.uid() != euid() || m.mode() & 0o022 != 0) {
                return Err(Error::UnsafeSocketDir {
                    path: dir.to_path_buf(),
                    uid: euid(),
                    owner: m.uid(),
                    mode: m.mode() & 0o7777,
                });
            }
            Ok(())
        }
    }
}

/// Clears the way for a socket at `path`: nothing there, or a stale socket (nobody accepts on it:
/// a connect is refused), which is removed. Anything else is an error and is left alone.
pub(super) fn clear_stale_socket(path: &Path) -> Result<(), Error> {
    if crate::seeded::seeded("bind-deletes-anything") && UnixStream::connect(path).is_err() {
        let _ = std::fs::remove_file(path);
    }
    let m = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(Error::Io { what: "reading the socket path", path: path.to_path_buf(), source }),
        Ok(m) => m,
    };
    if !m.file_type().is_socket() {
        let what = if m.is_dir() {
            "a directory"
        } else if m.file_type().is_symlink() {
            "a symbolic link"
        } else if m.is_file() {
            "a regular file"
        } else {
            "not a socket"
        };
        return Err(Error::SocketPathTaken { path: path.to_path_buf(), found: what });
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(Error::DaemonRunning { path: path.to_path_buf() }),
        Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => std::fs::remove_file(path)
            .map_err(|source| Error::Io { what: "removing the stale socket", path: path.to_path_buf(), source }),
        Err(source) => Err(Error::SocketUnprobed { path: path.to_path_buf(), source }),
    }
}

/// The file `PATH.lock` beside the socket `path`: held (`flock`) while a daemon probes, unlinks
/// and binds `path`.
pub(super) fn lock_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".lock");
    PathBuf::from(p)
}

/// Takes the exclusive `flock` on `PATH.lock` (created `0600` if missing, never through a
/// symbolic link), waiting for a daemon that holds it, so two daemons starting at once cannot
/// unlink each other's fresh socket. Released when the returned file is dropped.
pub(super) fn lock_bind(path: &Path) -> Result<std::fs::File, Error> {
    use std::os::unix::fs::OpenOptionsExt;
    let lp = lock_path(path);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&lp)
        .map_err(|source| Error::Io { what: "opening the socket's lock file", path: lp.clone(), source })?;
    if crate::seeded::seeded("bind-unlocked") {
        return Ok(f);
    }
    loop {
        // SAFETY: flock on a file descriptor we own; it blocks until the lock is ours.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(f);
        }
        let source = std::io::Error::last_os_error();
        if source.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::Io { what: "locking", path: lp, source });
        }
    }
}

/// Serializes this process's umask changes around binds: two binds at once on two threads would
/// otherwise restore each other's mask (one binding under the old umask, the mask left `0177`).
pub(super) static UMASK: Mutex<()> = Mutex::new(());

/// Binds the Unix socket `path` with the process umask set to `0177` (the previous umask is
/// restored before returning), so the socket is never more open than `0600` between `bind` and
/// the mode it is given next, whatever the umask (`002`, `0`) was. The umask is process-wide:
/// a file another thread creates during the bind gets at most `0600` too.
pub(super) fn bind_socket(path: &Path) -> Result<UnixListener, Error> {
    let _serial = UMASK.lock().unwrap_or_else(|p| p.into_inner());
    bind_under_private_umask(path)
}

/// [`bind_socket`]'s work; the caller holds [`UMASK`].
pub(super) fn bind_under_private_umask(path: &Path) -> Result<UnixListener, Error> {
    let mask = if crate::seeded::seeded("bind-umask-window") { None } else { Some(0o177) };
    // SAFETY: umask sets the process's file mode creation mask and returns the old one.
    let old = mask.map(|m| unsafe { libc::umask(m) });
    let bound = UnixListener::bind(path);
    if let Some(old) = old {
        // SAFETY: as above; restores the mask read when it was set.
        unsafe { libc::umask(old) };
    }
    bound.map_err(|source| Error::Io { what: "binding the socket", path: path.to_path_buf(), source })
}

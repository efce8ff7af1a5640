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
///
/// The lock is on the file `PATH.lock` names when the lock is taken: a lock won on a file that
/// was unlinked (or replaced) meanwhile is dropped and taken again on the new one, which is what
/// lets [`remove_lock_file`] unlink it on a clean stop without two daemons each holding "the" lock.
pub(super) fn lock_bind(path: &Path) -> Result<std::fs::File, Error> {
    loop {
        if let Some(f) = lock_once(path, true)? {
            return Ok(f);
        }
    }
}

/// One try at [`lock_bind`]: `Some` with the lock on the file `PATH.lock` names now; `None` when
/// the file was unlinked or replaced while this waited (try again), or, with `wait` false, when
/// another holds the lock.
fn lock_once(path: &Path, wait: bool) -> Result<Option<std::fs::File>, Error> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
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
        return Ok(Some(f));
    }
    let op = if wait { libc::LOCK_EX } else { libc::LOCK_EX | libc::LOCK_NB };
    loop {
        // SAFETY: flock on a file descriptor we own; with LOCK_EX alone it blocks until the lock
        // is ours.
        if unsafe { libc::flock(f.as_raw_fd(), op) } == 0 {
            break;
        }
        let source = std::io::Error::last_os_error();
        match source.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock if !wait => return Ok(None),
            _ => return Err(Error::Io { what: "locking", path: lp, source }),
        }
    }
    // Still the file the path names? (A clean stop may have unlinked it while we waited.)
    let held = f.metadata().map_err(|source| Error::Io { what: "reading the lock file", path: lp.clone(), source })?;
    match std::fs::symlink_metadata(&lp) {
        Ok(now) if (now.dev(), now.ino()) == (held.dev(), held.ino()) => Ok(Some(f)),
        _ => Ok(None),
    }
}

/// On a clean stop: unlinks `PATH.lock` if this process can take its lock at once, so no daemon
/// is binding `path` now. Safe because a lock holder checks, once it holds the lock, that the
/// path still names its file ([`lock_bind`]): a daemon that opened the old file waits, then
/// finds it unlinked and locks a new one, so two daemons never both hold the bind lock. When
/// another daemon holds it (binding the path after us), the file is left to it. True if removed.
pub(super) fn remove_lock_file(path: &Path) -> bool {
    match lock_once(path, false) {
        Ok(Some(_held)) => std::fs::remove_file(lock_path(path)).is_ok(),
        _ => false,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn ino(f: &std::fs::File) -> u64 {
        f.metadata().unwrap().ino()
    }

    #[test]
    fn the_lock_file_is_removed_only_when_free_and_a_waiter_relocks_the_new_file() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("d.sock");
        let lp = lock_path(&sock);
        let held = lock_bind(&sock).unwrap();
        assert!(!remove_lock_file(&sock), "another holds the lock: the file stays");
        assert!(lp.exists());
        // A daemon starting now opens the current file and waits for its lock.
        let waiter = std::thread::spawn({
            let sock = sock.clone();
            move || lock_bind(&sock).unwrap()
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        // The holder stops cleanly: it unlinks the file it holds, then lets go.
        std::fs::remove_file(&lp).unwrap();
        drop(held);
        let won = waiter.join().unwrap();
        let now = std::fs::symlink_metadata(&lp).expect("the waiter made a new lock file");
        assert_eq!(ino(&won), now.ino(), "the waiter holds the file the path names, not the unlinked one");
        assert!(!remove_lock_file(&sock));
        drop(won);
        assert!(remove_lock_file(&sock), "free: removed");
        assert!(!lp.exists());
    }
}

//! Garbage collection of a connected tier's leases without the GIL.
//!
//! Dropping the last handle of a lease of a tier from `kvtier.connect` sends the daemon a
//! `DropLease` message, which waits for the connection: another thread may hold it for a whole
//! round trip (with the GIL released), and the daemon's socket may be full. A `Lease` collected by
//! Python runs its destructor with the GIL held, where no wait is allowed (a thread holding the
//! connection may need the GIL to finish). So the destructor hands such a lease to this module's
//! thread, which drops it there; in-process leases (a few atomic operations) are dropped at once.
//! A `Rank` collected unclosed drains its copies (for a connected tier, daemon round trips): it is
//! handed to the same thread with its tensors, which are released after the drain.

use kvtier::{Lease, Rank};
use pyo3::{Py, PyAny};
use std::sync::{mpsc, OnceLock};

enum Job {
    Drop(Lease),
    /// A rank collected unclosed: dropped (drained) first, then the tensors it copied to and from.
    Rank(Rank, Py<PyAny>),
    /// Answered once every lease sent before it has been dropped.
    Mark(mpsc::SyncSender<()>),
}

struct Reaper {
    /// The process that started the thread: a forked child has the channel but not the thread.
    pid: u32,
    tx: mpsc::Sender<Job>,
}

static REAPER: OnceLock<Option<Reaper>> = OnceLock::new();

/// This process's reaper thread, started on first use; None if it could not be started or if
/// this is a forked child of the process that started it.
fn reaper() -> Option<&'static Reaper> {
    REAPER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name("kvtier-py-leases".into())
                .spawn(move || {
                    for job in rx {
                        match job {
                            Job::Drop(lease) => drop(lease),
                            Job::Rank(rank, watch) => {
                                drop(rank);
                                // Without the GIL: pyo3 releases the reference the next time
                                // a thread takes the GIL.
                                drop(watch);
                            }
                            Job::Mark(done) => {
                                let _ = done.send(());
                            }
                        }
                    }
                })
                .ok()?;
            Some(Reaper { pid: std::process::id(), tx })
        })
        .as_ref()
        .filter(|r| r.pid == std::process::id())
}

/// Drops `lease` without waiting for a daemon connection: a connected tier's lease goes to the
/// reaper thread, any other is dropped here. (In a forked child the lease is dropped here too: its
/// connection belongs to the parent, so dropping it sends nothing and never waits.)
pub fn drop_lease(lease: Lease) {
    if lease.token().is_none() {
        // An in-process lease, or a daemon lease settled from birth: dropping it sends nothing.
        drop(lease);
        return;
    }
    match reaper() {
        Some(r) => {
            if let Err(mpsc::SendError(job)) = r.tx.send(Job::Drop(lease)) {
                drop(job);
            }
        }
        None => drop(lease),
    }
}

/// Drops `rank` (it drains: a connected rank's in-flight copies finish with daemon round trips,
/// up to the reply timeout each) and then `watch` (the tensors' references) on the reaper thread,
/// so a rank garbage-collected unclosed never drains with the GIL held. In a forked child (no
/// reaper thread) both are dropped here: the child's copies of the parent's completion threads do
/// not exist, and its connection belongs to the parent, so dropping sends nothing.
pub fn drop_rank(rank: Rank, watch: Py<PyAny>) {
    match reaper() {
        Some(r) => {
            if let Err(mpsc::SendError(job)) = r.tx.send(Job::Rank(rank, watch)) {
                drop(job);
            }
        }
        None => {
            drop(rank);
            drop(watch);
        }
    }
}

/// Blocks until every lease handed to [`drop_lease`] (and rank to [`drop_rank`]) before this call has been dropped (its
/// `DropLease` sent). Call it with the GIL released.
pub fn settle() {
    let Some(r) = reaper() else { return };
    let (tx, rx) = mpsc::sync_channel(1);
    if r.tx.send(Job::Mark(tx)).is_ok() {
        let _ = rx.recv();
    }
}

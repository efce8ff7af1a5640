//! Each session's own counters ([`ClientCounters`]), registered in the daemon's [`Clients`] (held
//! by its shared state) for as long as the session lives, and their sum by client process
//! ([`Clients::rows`]): what `kvtier stats` shows as its top clients.

use crate::remote::proto::WireClient;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One session's counters: gauges the session stores after each request, counters it adds to.
pub(super) struct ClientCounters {
    pub(super) pid: Option<u32>,
    pub(super) since: Instant,
    pub(super) lease_handles: AtomicU64,
    pub(super) leased_blocks: AtomicU64,
    pub(super) hints: AtomicU64,
    pub(super) copies: AtomicU64,
    pub(super) queries: AtomicU64,
    pub(super) hit_blocks: AtomicU64,
    pub(super) miss_blocks: AtomicU64,
    pub(super) saved_blocks: AtomicU64,
    pub(super) bytes_saved: AtomicU64,
    pub(super) restored_blocks: AtomicU64,
    pub(super) bytes_restored: AtomicU64,
    pub(super) hints_given: AtomicU64,
    pub(super) refused: AtomicU64,
}

impl ClientCounters {
    fn new(pid: Option<u32>) -> ClientCounters {
        let z = || AtomicU64::new(0);
        ClientCounters {
            pid,
            since: Instant::now(),
            lease_handles: z(),
            leased_blocks: z(),
            hints: z(),
            copies: z(),
            queries: z(),
            hit_blocks: z(),
            miss_blocks: z(),
            saved_blocks: z(),
            bytes_saved: z(),
            restored_blocks: z(),
            bytes_restored: z(),
            hints_given: z(),
            refused: z(),
        }
    }

    pub(super) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub(super) fn set(c: &AtomicU64, n: usize) {
        c.store(n as u64, Ordering::Relaxed);
    }
}

/// The live sessions' counters, by session id.
pub(super) struct Clients {
    sessions: Mutex<HashMap<u64, Arc<ClientCounters>>>,
    next_id: AtomicU64,
}

impl Clients {
    pub(super) fn new() -> Clients {
        Clients { sessions: Mutex::new(HashMap::new()), next_id: AtomicU64::new(1) }
    }

    /// Registers a new session of process `pid`: its id (for [`Clients::unregister`] and to leave
    /// it out of [`Clients::rows`]) and its counters.
    pub(super) fn register(&self, pid: Option<u32>) -> (u64, Arc<ClientCounters>) {
        let mut map = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        if crate::seeded::seeded("client-counters-shared") {
            if let Some(c) = map.values().next().cloned() {
                map.insert(id, c.clone());
                return (id, c);
            }
        }
        let c = Arc::new(ClientCounters::new(pid));
        map.insert(id, c.clone());
        (id, c)
    }

    /// The session `id` ended: its counters leave the daemon's view.
    pub(super) fn unregister(&self, id: u64) {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }

    /// The live sessions but `except`, summed by process: busiest first (bytes saved and restored,
    /// then queries), ties by pid.
    pub(super) fn rows(&self, except: u64) -> Vec<WireClient> {
        let sessions: Vec<Arc<ClientCounters>> = {
            let map = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
            map.iter().filter(|(id, _)| **id != except).map(|(_, c)| c.clone()).collect()
        };
        let now = Instant::now();
        let mut by_pid: HashMap<Option<u32>, WireClient> = HashMap::new();
        for c in sessions {
            let w = by_pid.entry(c.pid).or_insert_with(|| WireClient { pid: c.pid, ..WireClient::default() });
            let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
            w.sessions += 1;
            w.connected_ms = w.connected_ms.max(now.saturating_duration_since(c.since).as_millis() as u64);
            w.lease_handles += l(&c.lease_handles);
            w.leased_blocks += l(&c.leased_blocks);
            w.hints += l(&c.hints);
            w.copies_in_flight += l(&c.copies);
            w.queries += l(&c.queries);
            w.hit_blocks += l(&c.hit_blocks);
            w.miss_blocks += l(&c.miss_blocks);
            w.saved_blocks += l(&c.saved_blocks);
            w.bytes_saved += l(&c.bytes_saved);
            w.restored_blocks += l(&c.restored_blocks);
            w.bytes_restored += l(&c.bytes_restored);
            w.hints_given += l(&c.hints_given);
            w.refused += l(&c.refused);
        }
        let mut rows: Vec<WireClient> = by_pid.into_values().collect();
        rows.sort_by(|a, b| {
            let moved = |w: &WireClient| w.bytes_saved.saturating_add(w.bytes_restored);
            moved(b).cmp(&moved(a)).then(b.queries.cmp(&a.queries)).then(a.pid.cmp(&b.pid))
        });
        rows
    }
}

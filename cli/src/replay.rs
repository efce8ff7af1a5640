//! Trace replay through [`HostTier`] in pure host-tier mode (no GPU prefix cache): the engine side of
//! `kvtier replay`.
//!
//! For each request (its full pages and keys from [`TraceRequest::page_keys`]):
//!
//! 1. take `n` free GPU pages from the replay's GPU-page free list (waiting while other requests in
//!    flight hold them);
//! 2. `tier.query(keys)`: a lease over the longest run of leading resident pages (`h` hits);
//! 3. restore the lease into the first `h` GPU pages and wait (the restore latency is measured from
//!    submission to completion);
//! 4. verify those `h` pages byte for byte against the pattern of their keys ([`kvtier::pattern`]);
//!    any mismatch fails the run;
//! 5. "prefill" pages `h..n`: write the pattern of each key into its GPU page;
//! 6. save pages `h..n` with [`Fit::Prefix`]: resident pages copy nothing (their recency is
//!    refreshed), missing pages are copied, as many leading ones as the pool can hold (the rest are
//!    counted as dropped); wait for the copy, then give the GPU pages back.
//!
//! With `concurrency == 1` every request, save included, completes before the next starts, so the
//! hit count is a deterministic function of the trace, the pool capacity and the policy (and equals
//! the reference model in `tests/replay.rs` for LRU). With `concurrency = N`, N worker threads take
//! requests in file order and run them concurrently against one rank.
//!
//! With an SSD tier ([`ReplayConfig::ssd`]) the query of step 2 also promotes the blocks that
//! continue its host prefix from the drive ([`kvtier::Lease::promoted`]; they are restored and
//! verified like the host hits), and blocks are demoted to the drive at their admitting use. With
//! `concurrency == 1` each request also waits for the demotions it queued
//! ([`HostTier::flush_demotions`]), so the hits stay a deterministic function of the trace; with
//! more, demotions run behind the requests, as in an engine. Every replay waits for them before its
//! report.

use crate::error::{Error, ReplayError};
use crate::simulate::HintQueue;
use crate::trace::{pages_per_block, TraceRequest};
use hdrhistogram::Histogram;
use kvtier::BackingChoice;
use kvtier::PolicyKind;
use kvtier::TierError;
use kvtier::{EngineArenas, WaitFor};
use kvtier::{Fit, HostTier, Rank, SaveOptions, SsdConfig, SsdStats, TierConfig, TierStats};
use serde::Serialize;
use std::fmt;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// What to replay and how.
#[derive(Clone, Debug)]
pub struct ReplayConfig {
    /// Eviction policy of the tier.
    pub policy: PolicyKind,
    /// Host pool size in bytes (capacity = `floor(pool_bytes / slot_bytes)` slots).
    pub pool_bytes: u64,
    /// Which pages back the pool.
    pub backing: BackingChoice,
    /// GPU pages the replay may use; `None` = every page of the arenas. Must not exceed the arenas'
    /// page count, and must hold the largest request.
    pub gpu_pages: Option<u64>,
    /// Replay only the first `requests` requests (`None` = all).
    pub requests: Option<usize>,
    /// Requests in flight (worker threads), >= 1.
    pub concurrency: usize,
    /// Chain-aware victims ([`TierConfig::chain_aware`]).
    pub chain_aware: bool,
    /// Scheduler hints for an engine queue of this many requests (0: none): when request `i` is
    /// taken (trace order), requests `i + 1 ..= i + lookahead` are waiting and hinted
    /// ([`HostTier::hint`]), and request `i`'s hint is withdrawn.
    pub lookahead: usize,
    /// An SSD tier under the pool (`None`: the host pool alone). Its files are created, or
    /// reopened with the blocks they hold (a replay on the file of an earlier one finds its blocks
    /// again).
    pub ssd: Option<SsdConfig>,
}

impl Default for ReplayConfig {
    /// The default policy with chain-aware victims (the tier's defaults), 4 GiB pool, automatic
    /// backing, all arena pages, all requests, one at a time, no hints, no SSD tier.
    fn default() -> Self {
        ReplayConfig {
            policy: PolicyKind::default(),
            pool_bytes: 4 << 30,
            backing: BackingChoice::Auto,
            gpu_pages: None,
            requests: None,
            concurrency: 1,
            chain_aware: true,
            lookahead: 0,
            ssd: None,
        }
    }
}

/// GPU pages needed to replay `requests` with `concurrency` requests in flight:
/// the largest request's page count times `concurrency` (at least 1).
///
/// # Errors
/// [`Error::Config`] if `page_tokens` does not divide 512.
pub fn gpu_pages_needed(requests: &[TraceRequest], page_tokens: u32, concurrency: usize) -> Result<u64, Error> {
    check_page_tokens(page_tokens)?;
    let max = requests.iter().map(|r| r.page_count(page_tokens)).max().unwrap_or(0) as u64;
    Ok((max * concurrency.max(1) as u64).max(1))
}

fn check_page_tokens(page_tokens: u32) -> Result<(), Error> {
    match pages_per_block(page_tokens) {
        Some(_) => Ok(()),
        None => Err(Error::Config(format!(
            "pages of {page_tokens} tokens do not divide the trace's 512-token blocks; replay needs a geometry \
             whose page size divides 512"
        ))),
    }
}

/// The result of a replay. Byte counts are payload bytes (pages x the geometry's block bytes);
/// GB = 10^9 B.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    /// Copy backend (`host`, `cuda`).
    pub backend: String,
    /// Model of the geometry.
    pub model: String,
    /// Bytes of one block (one page across all arenas).
    pub block_bytes: u64,
    /// Eviction policy.
    pub policy: String,
    /// Chain-aware victims.
    pub chain_aware: bool,
    /// Requests hinted ahead (0: no hints).
    pub lookahead: usize,
    /// Requests in flight.
    pub concurrency: usize,
    /// GPU pages used by the replay.
    pub gpu_pages: u64,
    /// Pool backing (`hugetlb`, `thp`, `plain`).
    pub pool_backing: String,
    /// Pool capacity in slots (blocks).
    pub pool_capacity_slots: u64,
    /// Pool capacity in bytes (`slots x slot_bytes`).
    pub pool_capacity_bytes: u64,
    /// Requests replayed.
    pub requests: u64,
    /// Full pages over all requests.
    pub pages: u64,
    /// Pages served from the tier (leading resident pages, restored).
    pub hit_pages: u64,
    /// `hit_pages / pages` (0 when there are no pages).
    pub page_hit_ratio: f64,
    /// Pages copied GPU -> host by saves.
    pub saved_pages: u64,
    /// Pages a save skipped because they were already resident (recency refreshed, nothing copied).
    pub resident_pages: u64,
    /// Pages a save skipped because another save of the same key was in flight.
    pub in_flight_pages: u64,
    /// Missing pages not saved because the pool could not hold them ([`Fit::Prefix`] drops).
    pub dropped_pages: u64,
    /// Pages of saves the tier refused outright (pool exhausted by pinned or in-flight slots).
    pub refused_pages: u64,
    /// Pages copied host -> GPU by restores (= `hit_pages`).
    pub restored_pages: u64,
    /// Bytes copied by saves.
    pub bytes_saved: u64,
    /// Bytes copied by restores.
    pub bytes_restored: u64,
    /// `bytes_saved / wall_s` (the replay time) in GB/s.
    pub save_gbps_wall: f64,
    /// `bytes_restored / wall_s` (the replay time) in GB/s.
    pub restore_gbps_wall: f64,
    /// `bytes_saved / summed save time` (submission to completion of each save) in GB/s.
    pub save_gbps_copy: f64,
    /// `bytes_restored / summed restore time` (submission to completion of each restore) in GB/s.
    pub restore_gbps_copy: f64,
    /// Restores (requests with at least one hit).
    pub restores: u64,
    /// Median restore latency, submission to completion, in microseconds (0 without restores).
    /// Percentiles come from an HdrHistogram of nanoseconds with 3 significant digits: the value
    /// reported is the upper end of the percentile's bucket, within 0.1 % of the exact sample.
    pub restore_latency_p50_us: f64,
    /// 99th percentile restore latency in microseconds (as the median; 0 without restores).
    pub restore_latency_p99_us: f64,
    /// Blocks evicted from the pool.
    pub evictions: u64,
    /// Restored pages checked byte for byte against their keys (all of them; any mismatch fails
    /// the run, so a finished report always passed).
    pub verified_pages: u64,
    /// `passed` (a failed verification is an error, not a report).
    pub verification: String,
    /// Set-up time in seconds: the tier made (its pool mapped and prefaulted, so this grows with
    /// `--pool`) and the backend attached, before the first request.
    pub setup_s: f64,
    /// Replay time in seconds: the requests, first to last (set-up and the final wait for the SSD
    /// tier's demotions excluded); the "over wall time" rates divide by it.
    pub wall_s: f64,
    /// The run's time in seconds: set-up, replay and the final wait for the SSD tier's demotions
    /// (the command's own total adds reading the trace and making the GPU arenas).
    pub run_s: f64,
    /// The tier's own counters at the end.
    pub tier: TierStats,
    /// The SSD tier's figures (absent without one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssd: Option<SsdReport>,
}

/// The SSD tier's part of a [`ReplayReport`]: the hit split and the tier's counters at the end
/// ([`HostTier::ssd_stats`], after every demotion was written). Counts are blocks (= pages), bytes
/// are payload bytes.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct SsdReport {
    /// Slot files (drives).
    pub files: usize,
    /// How blocks are admitted to the drive: the number of uses (`"2"`), or `"auto"`
    /// ([`kvtier::SsdAdmit`]).
    pub admit: String,
    /// Disk slots over every file.
    pub capacity_blocks: u64,
    /// Bytes of one disk slot (the block and its trailer, rounded up to 4 KiB).
    pub disk_slot_bytes: u64,
    /// Hit pages the host pool held (the leading `len - promoted` pages of each lease).
    pub host_hit_pages: u64,
    /// Hit pages promoted from the drive (the sum of [`kvtier::Lease::promoted`] over the
    /// queries); `host_hit_pages + promoted_pages` is the report's `hit_pages`.
    pub promoted_pages: u64,
    /// Blocks on the drive at the end.
    pub blocks: u64,
    /// Blocks found on the drive when its files were opened (an earlier run's).
    pub recovered_blocks: u64,
    /// Slots found torn when the files were opened (now free).
    pub recovered_torn: u64,
    /// Slots found holding another namespace's block when the files were opened (now free).
    pub recovered_foreign: u64,
    /// Blocks written to the drive.
    pub demoted_blocks: u64,
    /// Bytes written to the drive.
    pub bytes_demoted: u64,
    /// Queued demotions not done (the block was evicted first, or was on the drive already).
    pub demotions_skipped: u64,
    /// Demotions not queued: the queue was full.
    pub demotions_dropped: u64,
    /// Demotions whose write failed.
    pub demotion_failures: u64,
    /// Blocks read back from the drive (= `promoted_pages`).
    pub promoted_blocks: u64,
    /// Bytes read back from the drive.
    pub bytes_promoted: u64,
    /// Blocks that failed to read or verify: never served, dropped from the drive.
    pub promotion_failures: u64,
    /// Drive blocks evicted to make room for demotions.
    pub disk_evictions: u64,
    /// Transfers with `O_DIRECT`.
    pub io_direct: u64,
    /// Transfers through the page cache (the filesystem refused `O_DIRECT`).
    pub io_buffered: u64,
}

impl SsdReport {
    fn new(config: &SsdConfig, disk_slot_bytes: u64, s: &SsdStats, hits: u64, promoted: u64) -> Self {
        // Seeded bug (tests only): promoted pages are counted as host hits too.
        let host = if crate::seeded::seeded("replay-promoted-as-host-hits") { hits } else { hits - promoted };
        SsdReport {
            files: config.files.len(),
            admit: config.admit.to_string(),
            capacity_blocks: s.capacity,
            disk_slot_bytes,
            host_hit_pages: host,
            promoted_pages: promoted,
            blocks: s.blocks,
            recovered_blocks: s.recovered_blocks,
            recovered_torn: s.recovered_torn,
            recovered_foreign: s.recovered_foreign,
            demoted_blocks: s.demoted_blocks,
            bytes_demoted: s.bytes_demoted,
            demotions_skipped: s.demotions_skipped,
            demotions_dropped: s.demotions_dropped,
            demotion_failures: s.demotion_failures,
            promoted_blocks: s.promoted_blocks,
            bytes_promoted: s.bytes_promoted,
            promotion_failures: s.promotion_failures,
            disk_evictions: s.disk_evictions,
            io_direct: s.io_direct,
            io_buffered: s.io_buffered,
        }
    }

    /// The report's rows for the SSD tier.
    fn rows(&self) -> Vec<(&'static str, String)> {
        let gb = |b: u64| b as f64 / 1e9;
        vec![
            (
                "SSD tier",
                format!(
                    "{} disk slots of {} B ({:.2} GB), {} file{}, admitted after {} uses",
                    self.capacity_blocks,
                    self.disk_slot_bytes,
                    gb(self.capacity_blocks * self.disk_slot_bytes),
                    self.files,
                    if self.files == 1 { "" } else { "s" },
                    self.admit
                ),
            ),
            ("hit split", format!("{} host pages, {} promoted from the SSD", self.host_hit_pages, self.promoted_pages)),
            (
                "SSD demoted",
                format!(
                    "{} blocks, {:.2} GB ({} skipped, {} dropped, {} failed)",
                    self.demoted_blocks,
                    gb(self.bytes_demoted),
                    self.demotions_skipped,
                    self.demotions_dropped,
                    self.demotion_failures
                ),
            ),
            (
                "SSD promoted",
                format!(
                    "{} blocks, {:.2} GB ({} failed verification)",
                    self.promoted_blocks,
                    gb(self.bytes_promoted),
                    self.promotion_failures
                ),
            ),
            (
                "SSD blocks",
                format!(
                    "{} held, {} evicted, {} recovered at open ({} torn, {} foreign)",
                    self.blocks,
                    self.disk_evictions,
                    self.recovered_blocks,
                    self.recovered_torn,
                    self.recovered_foreign
                ),
            ),
            ("SSD transfers", format!("{} direct, {} buffered", self.io_direct, self.io_buffered)),
        ]
    }
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    let s = d.as_secs_f64();
    if s > 0.0 {
        bytes as f64 / s / 1e9
    } else {
        0.0
    }
}

/// A latency histogram: nanoseconds, 3 significant digits, growing as needed.
fn latency_histogram() -> Histogram<u64> {
    Histogram::new(3).expect("3 significant digits is a valid precision")
}

/// Quantile `q` (0..=1) of `h` in microseconds (the upper end of its bucket), 0 for an empty
/// histogram.
fn quantile_us(h: &Histogram<u64>, q: f64) -> f64 {
    if h.is_empty() {
        0.0
    } else {
        h.value_at_quantile(q) as f64 / 1e3
    }
}

impl fmt::Display for ReplayReport {
    /// A human-readable table.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gb = |b: u64| b as f64 / 1e9;
        let mut rows: Vec<(&str, String)> = vec![
            ("backend", self.backend.clone()),
            ("model", format!("{} ({} B per block)", self.model, self.block_bytes)),
            (
                "policy",
                format!(
                    "{}, chain-aware {}, {}",
                    self.policy,
                    if self.chain_aware { "on" } else { "off" },
                    if self.lookahead > 0 {
                        format!("hints for the next {} requests", self.lookahead)
                    } else {
                        "no hints".to_string()
                    }
                ),
            ),
            ("concurrency", self.concurrency.to_string()),
            ("GPU pages", self.gpu_pages.to_string()),
            (
                "pool",
                format!(
                    "{} slots, {:.2} GB, backing {}",
                    self.pool_capacity_slots,
                    gb(self.pool_capacity_bytes),
                    self.pool_backing
                ),
            ),
            ("requests", self.requests.to_string()),
            ("pages", self.pages.to_string()),
            ("hit pages", self.hit_pages.to_string()),
            ("page hit ratio", format!("{:.4}", self.page_hit_ratio)),
            (
                "saved",
                format!(
                    "{} pages, {:.2} GB ({} resident, {} in flight, {} dropped, {} refused)",
                    self.saved_pages,
                    gb(self.bytes_saved),
                    self.resident_pages,
                    self.in_flight_pages,
                    self.dropped_pages,
                    self.refused_pages
                ),
            ),
            (
                "restored",
                format!(
                    "{} pages, {:.2} GB in {} restores",
                    self.restored_pages,
                    gb(self.bytes_restored),
                    self.restores
                ),
            ),
            (
                "save GB/s",
                format!(
                    "{:.2} over replay time, {:.2} over summed save time",
                    self.save_gbps_wall, self.save_gbps_copy
                ),
            ),
            (
                "restore GB/s",
                format!(
                    "{:.2} over replay time, {:.2} over summed restore time",
                    self.restore_gbps_wall, self.restore_gbps_copy
                ),
            ),
            (
                "restore latency",
                format!("p50 {:.0} us, p99 {:.0} us", self.restore_latency_p50_us, self.restore_latency_p99_us),
            ),
            ("evictions", self.evictions.to_string()),
            ("verification", format!("{} ({} pages verified)", self.verification, self.verified_pages)),
            ("set-up time", format!("{:.3} s (pool mapped and prefaulted, backend attached)", self.setup_s)),
            ("replay time", format!("{:.3} s (the requests, first to last)", self.wall_s)),
            ("run time", format!("{:.3} s (set-up, replay, final flush of SSD demotions)", self.run_s)),
        ];
        if let Some(ssd) = &self.ssd {
            rows.extend(ssd.rows());
        }
        let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        for (k, v) in rows {
            writeln!(f, "{k:<w$}  {v}")?;
        }
        Ok(())
    }
}

/// Per-worker counters, merged at the end.
struct Acc {
    requests: u64,
    pages: u64,
    hits: u64,
    /// Hits promoted from the SSD tier.
    promoted: u64,
    saved: u64,
    resident: u64,
    in_flight: u64,
    dropped: u64,
    refused: u64,
    verified: u64,
    /// Restore latencies in ns.
    restore_lat: Histogram<u64>,
    restore_time: Duration,
    save_time: Duration,
}

impl Default for Acc {
    fn default() -> Self {
        Acc {
            requests: 0,
            pages: 0,
            hits: 0,
            promoted: 0,
            saved: 0,
            resident: 0,
            in_flight: 0,
            dropped: 0,
            refused: 0,
            verified: 0,
            restore_lat: latency_histogram(),
            restore_time: Duration::ZERO,
            save_time: Duration::ZERO,
        }
    }
}

impl Acc {
    fn merge(&mut self, o: Acc) {
        self.requests += o.requests;
        self.pages += o.pages;
        self.hits += o.hits;
        self.promoted += o.promoted;
        self.saved += o.saved;
        self.resident += o.resident;
        self.in_flight += o.in_flight;
        self.dropped += o.dropped;
        self.refused += o.refused;
        self.verified += o.verified;
        self.restore_lat.add(&o.restore_lat).expect("auto-resizing histograms always add");
        self.restore_time += o.restore_time;
        self.save_time += o.save_time;
    }
}

/// The replay's GPU-page free list: requests take pages for their lifetime and give them back.
struct GpuPages {
    free: Mutex<Vec<u64>>,
    returned: Condvar,
}

impl GpuPages {
    fn new(pages: u64) -> Self {
        // LIFO, lowest ids on top: recently used (already touched) pages are reused first.
        GpuPages { free: Mutex::new((0..pages).rev().collect()), returned: Condvar::new() }
    }

    /// Takes `n` pages (`n` <= the total, checked by the caller), waiting until they are free.
    fn take(&self, n: usize) -> PageLease<'_> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        while free.len() < n {
            free = self.returned.wait(free).unwrap_or_else(|e| e.into_inner());
        }
        let at = free.len() - n;
        let mut pages = free.split_off(at);
        pages.reverse();
        PageLease { owner: self, pages }
    }
}

/// GPU pages held by one request; given back on drop (also on error paths).
struct PageLease<'a> {
    owner: &'a GpuPages,
    pages: Vec<u64>,
}

impl Drop for PageLease<'_> {
    fn drop(&mut self) {
        let mut free = self.owner.free.lock().unwrap_or_else(|e| e.into_inner());
        free.extend(self.pages.drain(..).rev());
        drop(free);
        self.owner.returned.notify_all();
    }
}

/// Work queue shared by the workers: next request index, a stop flag set by the first error, and
/// the modelled engine queue's hints.
struct Queue {
    next: usize,
    stop: bool,
    hints: HintQueue,
}

/// Replays `requests` (the first `config.requests` of them) through a new [`HostTier`] over
/// `arenas` (one rank), calling `progress(1)` after each completed request.
///
/// The geometry is `arenas.geometry()`; the replay uses GPU pages `0..config.gpu_pages` (default:
/// all of the arenas' pages).
///
/// # Errors
/// [`Error::Config`] for a concurrency of 0, a page size that does not divide 512, more GPU
/// pages than the arenas have, or an SSD tier file too small for one block (checked before any
/// file is created); [`ReplayError::NoRequests`]; [`ReplayError::RequestTooLarge`] (before
/// anything runs) if a request has more pages than the GPU pages; pool and tier construction
/// errors; [`kvtier::Error::Verification`] (inside [`Error::Kvtier`]) if a restored page differs
/// from its key's bytes; copy and tier errors of any request (the first one stops the replay).
pub fn run(
    requests: &[TraceRequest],
    config: &ReplayConfig,
    arenas: &dyn EngineArenas,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<ReplayReport, Error> {
    let began = Instant::now();
    let geometry = arenas.geometry().clone();
    let page_tokens = geometry.page_tokens();
    check_page_tokens(page_tokens)?;
    if config.concurrency == 0 {
        return Err(Error::Config("concurrency must be at least 1".into()));
    }
    let requests = &requests[..config.requests.unwrap_or(usize::MAX).min(requests.len())];
    if requests.is_empty() {
        return Err(ReplayError::NoRequests.into());
    }
    let gpu_pages = config.gpu_pages.unwrap_or(geometry.pages());
    if gpu_pages > geometry.pages() {
        return Err(Error::Config(format!(
            "{gpu_pages} GPU pages asked for but the arenas hold {} pages",
            geometry.pages()
        )));
    }
    for (i, r) in requests.iter().enumerate() {
        let pages = r.page_count(page_tokens);
        if pages as u64 > gpu_pages {
            return Err(ReplayError::RequestTooLarge { request: i + 1, pages, gpu_pages }.into());
        }
    }

    if let Some(ssd) = &config.ssd {
        for f in &ssd.files {
            if geometry.disk_slots(f.bytes) == 0 {
                return Err(Error::Config(format!(
                    "SSD file {}: {} B hold no block of {} B (a 4096 B header, then disk slots of {} B)",
                    f.path.display(),
                    f.bytes,
                    geometry.slot_bytes(),
                    geometry.disk_slot_bytes()
                )));
            }
        }
    }

    // Prefault so copies are timed against resident memory, as an engine would set the pool up.
    let pool = kvtier::PoolConfig::new(config.pool_bytes).with_backing(config.backing).with_prefault(true);
    let mut tier_config = TierConfig::new(geometry.clone(), config.pool_bytes)
        .with_pool(pool)
        .with_policy(config.policy)
        .with_chain_aware(config.chain_aware);
    if let Some(ssd) = &config.ssd {
        tier_config = tier_config.with_ssd(ssd.clone());
    }
    let tier = HostTier::new(tier_config)?;
    // One request at a time: each waits for its demotions, so the hits are deterministic.
    let flush_each = config.concurrency == 1 && config.ssd.is_some();
    let backend = arenas.backend()?;
    let backend_name = backend.name().to_string();
    let rank = tier.attach(backend)?;
    let ns = geometry.namespace();
    let gpu = GpuPages::new(gpu_pages);
    let queue = Mutex::new(Queue { next: 0, stop: false, hints: HintQueue::new(config.lookahead) });
    let workers = config.concurrency.min(requests.len());

    let start = Instant::now();
    let setup = start - began;
    let results: Vec<Result<Acc, Error>> = std::thread::scope(|s| {
        let worker = || {
            let mut acc = Acc::default();
            loop {
                let i = {
                    let mut q = queue.lock().unwrap_or_else(|e| e.into_inner());
                    if q.stop || q.next >= requests.len() {
                        return Ok(acc);
                    }
                    q.next += 1;
                    let i = q.next - 1;
                    q.hints.admit(&tier, i, requests.len(), |j| requests[j].page_keys(&ns, page_tokens));
                    i
                };
                let keys = requests[i].page_keys(&ns, page_tokens);
                if let Err(e) = one_request(&tier, &rank, arenas, &gpu, &keys, &mut acc) {
                    queue.lock().unwrap_or_else(|e| e.into_inner()).stop = true;
                    return Err(e);
                }
                if flush_each {
                    tier.flush_demotions();
                }
                progress(1);
            }
        };
        let handles: Vec<_> = (1..workers).map(|_| s.spawn(worker)).collect();
        let mut results = vec![worker()];
        results.extend(handles.into_iter().map(|h| h.join().expect("replay worker panicked")));
        results
    });
    let wall = start.elapsed();
    // The demotions still queued are written before the figures are read (not timed).
    tier.flush_demotions();
    let run_time = began.elapsed();

    let mut acc = Acc::default();
    for r in results {
        acc.merge(r?);
    }
    let stats = tier.stats();
    let ssd = match (&config.ssd, tier.ssd_stats()) {
        (Some(c), Some(s)) => Some(SsdReport::new(c, geometry.disk_slot_bytes(), &s, acc.hits, acc.promoted)),
        _ => None,
    };
    let block_bytes = geometry.block_bytes();
    let bytes_saved = acc.saved * block_bytes;
    let bytes_restored = acc.hits * block_bytes;
    let capacity = tier.capacity() as u64;
    Ok(ReplayReport {
        backend: backend_name,
        model: geometry.model().to_string(),
        block_bytes,
        policy: config.policy.name().to_string(),
        chain_aware: config.chain_aware,
        lookahead: config.lookahead,
        concurrency: config.concurrency,
        gpu_pages,
        pool_backing: tier.pool().backing().name().to_string(),
        pool_capacity_slots: capacity,
        pool_capacity_bytes: capacity * geometry.slot_bytes(),
        requests: acc.requests,
        pages: acc.pages,
        hit_pages: acc.hits,
        page_hit_ratio: if acc.pages > 0 { acc.hits as f64 / acc.pages as f64 } else { 0.0 },
        saved_pages: acc.saved,
        resident_pages: acc.resident,
        in_flight_pages: acc.in_flight,
        dropped_pages: acc.dropped,
        refused_pages: acc.refused,
        restored_pages: acc.hits,
        bytes_saved,
        bytes_restored,
        save_gbps_wall: gbps(bytes_saved, wall),
        restore_gbps_wall: gbps(bytes_restored, wall),
        save_gbps_copy: gbps(bytes_saved, acc.save_time),
        restore_gbps_copy: gbps(bytes_restored, acc.restore_time),
        restores: acc.restore_lat.len(),
        restore_latency_p50_us: quantile_us(&acc.restore_lat, 0.5),
        restore_latency_p99_us: quantile_us(&acc.restore_lat, 0.99),
        evictions: stats.evictions,
        verified_pages: acc.verified,
        verification: "passed".into(),
        setup_s: setup.as_secs_f64(),
        wall_s: wall.as_secs_f64(),
        run_s: run_time.as_secs_f64(),
        tier: stats,
        ssd,
    })
}

/// One request: query, restore + verify the hits, prefill and save the rest (see the module docs).
fn one_request(
    tier: &HostTier,
    rank: &Rank,
    arenas: &dyn EngineArenas,
    gpu: &GpuPages,
    keys: &[kvtier::ContentKey],
    acc: &mut Acc,
) -> Result<(), Error> {
    let n = keys.len();
    let held = gpu.take(n);
    let pages = &held.pages[..];
    let lease = tier.query(keys);
    let h = lease.len();
    acc.promoted += lease.promoted() as u64;
    if h > 0 {
        let t0 = Instant::now();
        let handle = rank.restore(&lease, &pages[..h], WaitFor::Nothing)?;
        handle.wait()?;
        let took = t0.elapsed();
        acc.restore_lat.record(took.as_nanos().try_into().unwrap_or(u64::MAX)).expect("auto-resizing histogram");
        acc.restore_time += took;
        arenas.verify(&pages[..h], &keys[..h])?;
        acc.verified += h as u64;
    }
    drop(lease);
    if h < n {
        arenas.fill(&pages[h..], &keys[h..])?;
        let t0 = Instant::now();
        // keys[h] is page h of its prompt, after keys[h - 1]: depth and parent for the policy and the
        // chain links.
        let mut opts = SaveOptions::new().fit(Fit::Prefix).prefix_depth(h as u32);
        if h > 0 {
            opts = opts.parent(keys[h - 1]);
        }
        match rank.save_with(&keys[h..], &pages[h..], WaitFor::Nothing, opts) {
            Ok(ticket) => {
                ticket.handle.wait()?;
                acc.save_time += t0.elapsed();
                acc.saved += ticket.saving.len() as u64;
                acc.resident += ticket.resident as u64;
                acc.in_flight += ticket.in_flight as u64;
                acc.dropped += ticket.dropped as u64;
            }
            Err(TierError::CannotFit { .. } | TierError::PoolExhausted { .. }) => acc.refused += (n - h) as u64,
            Err(e) => return Err(e.into()),
        }
    }
    acc.requests += 1;
    acc.pages += n as u64;
    acc.hits += h as u64;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_quantiles_are_bucket_upper_ends() {
        let mut h = latency_histogram();
        assert_eq!(quantile_us(&h, 0.5), 0.0);
        for us in 1..=100u64 {
            h.record(us * 1_000).unwrap();
        }
        // 3 significant digits: 50,000 ns lies in a bucket of 32 ns, [49,984, 50,015]; 99,000 ns in
        // one of 64 ns, [98,944, 99,007].
        assert_eq!(quantile_us(&h, 0.5), 50.015);
        assert_eq!(quantile_us(&h, 0.99), 99.007);
        let mut one = latency_histogram();
        one.record(1_000).unwrap();
        assert_eq!(quantile_us(&one, 0.99), 1.0);
    }

    #[test]
    fn gpu_pages_wait_and_return() {
        let g = GpuPages::new(4);
        let a = g.take(3);
        assert_eq!(a.pages, vec![0, 1, 2]);
        drop(a);
        let b = g.take(4);
        assert_eq!(b.pages, vec![0, 1, 2, 3]);
    }
}

//! One level of a simulated cache ([`Level`]: a real tier over the proxy geometry with a
//! [`kvtier::NullBackend`] rank) and the modelled engine queue whose requests are hinted
//! ([`HintQueue`]).

use super::config::Variant;
use crate::error::Error;
use kvtier::BackingChoice;
use kvtier::NullBackend;
use kvtier::SsdModel;
use kvtier::WaitFor;
use kvtier::{ArenaSpec, ContentKey, Geometry, TierError};
use kvtier::{Fit, HintId, HostTier, Rank, SaveOptions, TierConfig};
use std::time::{Duration, Instant};

/// The tier geometry of a simulation: `geometry`'s page size, one 16-byte arena of `pages` pages.
fn proxy_geometry(geometry: &Geometry, pages: u64) -> Result<Geometry, Error> {
    let g = Geometry::new(
        &format!("kvtier-simulate/{}", geometry.model()),
        geometry.page_tokens(),
        vec![ArenaSpec::packed("sim", 16, pages.max(1))],
    )?;
    Ok(g)
}

/// How long a modelled hint lasts: longer than any run, so hints end by withdrawal only.
pub const SIM_HINT_TTL: Duration = Duration::from_secs(24 * 3600);

/// One level of a simulated cache: a real [`HostTier`] of `slots` slots over the proxy geometry,
/// configured as `variant` says, with one [`NullBackend`] rank. Its queries "restore" the leased
/// prefix through the rank and its saves are waited for, as the replay does.
pub(crate) struct Level {
    pub(crate) tier: HostTier,
    rank: Rank,
    /// Page ids `0..max_pages` of the proxy arena: the pages request `i`'s page `j` uses.
    pages: Vec<u64>,
}

/// What [`Level::save`] did.
pub(crate) struct LevelSave {
    /// Pages not saved: they did not fit, or the pool refused them.
    pub(crate) dropped: u64,
    /// Time of the save call itself (probes, slot acquisition with eviction, submission).
    pub(crate) call: Duration,
}

impl Level {
    /// A level of `slots` slots for requests of at most `max_pages` pages; over `ssd` if given
    /// ([`HostTier::over_ssd_model`]: its victims take blocks the drive holds first, as the tier's do).
    ///
    /// # Errors
    /// Geometry and pool errors; [`Error::Config`] if the pool does not come out at `slots`.
    pub(crate) fn new(
        geometry: &Geometry,
        max_pages: u64,
        slots: u32,
        variant: Variant,
        ssd: Option<&mut SsdModel>,
    ) -> Result<Level, Error> {
        let proxy = proxy_geometry(geometry, max_pages)?;
        let bytes = slots as u64 * proxy.slot_bytes();
        let cfg = TierConfig::new(proxy.clone(), bytes)
            .with_backing(BackingChoice::Plain)
            .with_policy(variant.policy)
            .with_chain_aware(variant.chain)
            .with_protect_hinted(variant.protect);
        let tier = match ssd {
            Some(ssd) => HostTier::over_ssd_model(cfg, ssd)?,
            None => HostTier::new(cfg)?,
        };
        if tier.capacity() != slots {
            return Err(Error::Config(format!("pool of {bytes} B holds {} slots, not {slots}", tier.capacity())));
        }
        let rank = tier.attach(Box::new(NullBackend::new(proxy)))?;
        Ok(Level { tier, rank, pages: (0..max_pages).collect() })
    }

    /// Leases the longest resident prefix of `keys` (a request's pages from its page `from` on,
    /// which are pages `from..` of the proxy arena), restores it through the null backend and
    /// drops the lease. Returns the prefix's length in pages and the query call's time.
    ///
    /// # Errors
    /// Restore errors of the tier.
    pub(crate) fn query(&self, keys: &[ContentKey], from: usize) -> Result<(usize, Duration), Error> {
        let q0 = Instant::now();
        let lease = self.tier.query(keys);
        let took = q0.elapsed();
        let h = lease.len();
        if h > 0 {
            self.rank.restore(&lease, &self.pages[from..from + h], WaitFor::Nothing)?.wait()?;
        }
        Ok((h, took))
    }

    /// Saves pages `from..to` of a request whose page keys are `keys`, as the blocks at prefix
    /// depth `from..to` chained to `keys[from - 1]`, with [`Fit::Prefix`] (resident pages are
    /// refreshed, missing ones take slots, evicting by the policy), and waits for the save.
    ///
    /// # Errors
    /// Tier errors other than a refused save ([`TierError::CannotFit`],
    /// [`TierError::PoolExhausted`]: counted as dropped pages).
    pub(crate) fn save(&self, keys: &[ContentKey], from: usize, to: usize) -> Result<LevelSave, Error> {
        let s0 = Instant::now();
        let mut opts = SaveOptions::new().fit(Fit::Prefix).prefix_depth(from as u32);
        if from > 0 {
            opts = opts.parent(keys[from - 1]);
        }
        let r = self.rank.save_with(&keys[from..to], &self.pages[from..to], WaitFor::Nothing, opts);
        let call = s0.elapsed();
        let dropped = match r {
            Ok(t) => {
                t.handle.wait()?;
                t.dropped as u64
            }
            Err(TierError::CannotFit { .. } | TierError::PoolExhausted { .. }) => (to - from) as u64,
            Err(e) => return Err(e.into()),
        };
        Ok(LevelSave { dropped, call })
    }

    /// Blocks the level's policy evicted so far.
    pub(crate) fn evictions(&self) -> u64 {
        self.tier.stats().evictions
    }

    /// Detaches the rank.
    ///
    /// # Errors
    /// [`TierError`] if a copy is still in flight after 10 s.
    pub(crate) fn close(self) -> Result<(), Error> {
        self.rank.shutdown(Duration::from_secs(10))?;
        Ok(())
    }
}

/// The modelled engine queue of [`Variant::lookahead`] requests and their hints.
pub struct HintQueue {
    lookahead: usize,
    /// Hints of queued requests, by request index.
    live: std::collections::VecDeque<(usize, HintId)>,
    /// Next request index to enqueue.
    next: usize,
}

impl HintQueue {
    /// A queue of `lookahead` requests (0: no hints at all).
    pub fn new(lookahead: usize) -> Self {
        HintQueue { lookahead, live: Default::default(), next: 0 }
    }

    /// Request `i` of `total` is admitted: requests up to `i + lookahead` are queued (hinted with
    /// their keys, `keys_of(j)`) and request `i`'s own hint is withdrawn. Call once per request, in
    /// order.
    pub fn admit(&mut self, tier: &HostTier, i: usize, total: usize, keys_of: impl Fn(usize) -> Vec<ContentKey>) {
        if self.lookahead == 0 {
            return;
        }
        let end = (i + self.lookahead + 1).min(total);
        while self.next < end {
            self.live.push_back((self.next, tier.hint(&keys_of(self.next), SIM_HINT_TTL)));
            self.next += 1;
        }
        while let Some(&(j, id)) = self.live.front() {
            if j > i {
                break;
            }
            tier.withdraw_hint(id);
            self.live.pop_front();
        }
    }
}

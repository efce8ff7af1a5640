//! `kvtier stats`: a running daemon's tier ([`kvtier::TierStats`], read over its socket with
//! [`kvtier::HostTier::connect`]) as a table for a person, or as JSON once.
//!
//! The table shows the hit ratio (hit blocks over hit and missed blocks), what was saved and
//! restored (blocks and bytes), the slots by state, the leases and the evictions; given the
//! previous reading and the time since, also the copy rates each way in GB/s (10^9 B/s). Below it,
//! the top clients: the daemon's client processes ([`kvtier::HostTier::clients`]), busiest first,
//! one row each.

use kvtier::{ClientStats, SsdStats, TierStats};
use std::fmt::Write as _;
use std::time::Duration;

/// Bytes in one GB (10^9 B).
const GB: f64 = 1e9;

/// Hit blocks over hit and missed blocks, 0 before any query.
pub fn hit_ratio(s: &TierStats) -> f64 {
    let looked = s.hit_blocks + s.miss_blocks;
    if looked == 0 {
        0.0
    } else {
        s.hit_blocks as f64 / looked as f64
    }
}

/// Save and restore rates in GB/s (10^9 B/s) between two readings `elapsed` apart (`(0, 0)` for
/// no time; a counter that went back, as after a daemon restart, counts as 0).
pub fn rates(prev: &TierStats, now: &TierStats, elapsed: Duration) -> (f64, f64) {
    let secs = elapsed.as_secs_f64();
    if secs <= 0.0 {
        return (0.0, 0.0);
    }
    let d = |a: u64, b: u64| b.saturating_sub(a) as f64 / GB / secs;
    (d(prev.bytes_saved, now.bytes_saved), d(prev.bytes_restored, now.bytes_restored))
}

/// Client rows the table shows at most (the JSON has them all).
pub const TOP_CLIENTS: usize = 10;

/// The top clients as a table: a header and one row per process (the first [`TOP_CLIENTS`] of
/// `clients`, which come busiest first), then how many were left out; "none" without clients.
/// Bytes are GB (10^9 B); `connected` is seconds since the process's oldest session began.
pub fn clients_table(clients: &[ClientStats]) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "  top clients ({} processes)", clients.len());
    if clients.is_empty() {
        let _ = writeln!(t, "    none");
        return t;
    }
    let _ = writeln!(
        t,
        "    {:>8} {:>4} {:>9} {:>7} {:>7} {:>5} {:>7} {:>8} {:>11} {:>11} {:>7}",
        "pid",
        "conn",
        "connected",
        "leases",
        "leased",
        "hints",
        "queries",
        "hits",
        "saved GB",
        "restored GB",
        "refused"
    );
    for c in clients.iter().take(TOP_CLIENTS) {
        let pid = c.pid.map_or_else(|| "?".to_string(), |p| p.to_string());
        let _ = writeln!(
            t,
            "    {:>8} {:>4} {:>8.1}s {:>7} {:>7} {:>5} {:>7} {:>8} {:>11.3} {:>11.3} {:>7}",
            pid,
            c.sessions,
            c.connected_ms as f64 / 1e3,
            c.lease_handles,
            c.leased_blocks,
            c.hints,
            c.queries,
            c.hit_blocks,
            c.bytes_saved as f64 / GB,
            c.bytes_restored as f64 / GB,
            c.refused
        );
    }
    if clients.len() > TOP_CLIENTS {
        let _ = writeln!(t, "    ... {} more", clients.len() - TOP_CLIENTS);
    }
    t
}

/// The readable table of `now`; with `since` (the previous reading and the time since it), also the
/// GB/s each way over that interval.
pub fn table(now: &TierStats, since: Option<(&TierStats, Duration)>) -> String {
    let mut t = String::new();
    let gb = |b: u64| b as f64 / GB;
    let mut row = |name: &str, value: String| {
        let _ = writeln!(t, "  {name:<28} {value}");
    };
    row(
        "hit ratio (blocks)",
        format!("{:.4}  ({} hit, {} missed, {} queries)", hit_ratio(now), now.hit_blocks, now.miss_blocks, now.queries),
    );
    row("saved", format!("{} blocks, {:.3} GB", now.saved_blocks, gb(now.bytes_saved)));
    row(
        "saves skipped",
        format!(
            "{} resident, {} in flight, {} duplicate",
            now.save_skipped_resident, now.save_skipped_in_flight, now.save_skipped_duplicate
        ),
    );
    row(
        "saves refused / failed",
        format!(
            "{} refused, {} dropped, {} blocks failed",
            now.saves_refused, now.save_dropped, now.save_failed_blocks
        ),
    );
    row(
        "restored",
        format!(
            "{} blocks, {:.3} GB ({} blocks failed)",
            now.restored_blocks,
            gb(now.bytes_restored),
            now.restore_failed_blocks
        ),
    );
    if let Some((prev, elapsed)) = since {
        let (save, restore) = rates(prev, now, elapsed);
        row("rate", format!("save {save:.3} GB/s, restore {restore:.3} GB/s (last {:.1} s)", elapsed.as_secs_f64()));
    }
    row(
        "slots",
        format!(
            "{} capacity: {} free, {} writing, {} ready, {} evicting, {} pinned, {} quarantined",
            now.capacity,
            now.free_slots,
            now.writing_slots,
            now.ready_slots,
            now.evicting_slots,
            now.pinned_slots,
            now.quarantined_slots
        ),
    );
    row("index entries", now.index_entries.to_string());
    row(
        "leases",
        format!("{} live (oldest {} ms), {} expired", now.live_leases, now.oldest_lease_age_ms, now.expired_leases),
    );
    row(
        "evictions",
        format!(
            "{} blocks: {} for saves (capacity), {} asked for (explicit)",
            now.evictions,
            now.evictions.saturating_sub(now.explicit_evictions),
            now.explicit_evictions
        ),
    );
    t
}

/// `now` as one line of JSON: [`TierStats`]' fields by name, plus `hit_ratio`, `clients` (an
/// array of [`ClientStats`] objects, busiest first) and `ssd` (the daemon's SSD tier's
/// [`SsdStats`] fields by name, or `null` without an SSD tier).
pub fn json(now: &TierStats, clients: &[ClientStats], ssd: Option<&SsdStats>) -> String {
    let mut v = serde_json::to_value(now).expect("TierStats serialises");
    if let Some(m) = v.as_object_mut() {
        m.insert("hit_ratio".into(), serde_json::json!(hit_ratio(now)));
        m.insert("clients".into(), serde_json::to_value(clients).expect("ClientStats serialises"));
        m.insert("ssd".into(), serde_json::to_value(ssd).expect("SsdStats serialises"));
    }
    v.to_string()
}

/// The readable lines of the daemon's SSD tier (empty without one).
pub fn ssd_table(ssd: Option<&SsdStats>) -> String {
    let Some(s) = ssd else { return String::new() };
    let gb = |b: u64| b as f64 / GB;
    let mut t = String::from("SSD tier\n");
    let mut row = |name: &str, value: String| {
        let _ = writeln!(t, "  {name:<28} {value}");
    };
    row("blocks on disk", format!("{} of {}", s.blocks, s.capacity));
    row(
        "demoted",
        format!(
            "{} blocks ({:.3} GB), {} pending, {} skipped, {} dropped, {} failed",
            s.demoted_blocks,
            gb(s.bytes_demoted),
            s.demotions_pending,
            s.demotions_skipped,
            s.demotions_dropped,
            s.demotion_failures
        ),
    );
    row(
        "promoted",
        format!("{} blocks ({:.3} GB), {} failed", s.promoted_blocks, gb(s.bytes_promoted), s.promotion_failures),
    );
    row("disk evictions", s.disk_evictions.to_string());
    row(
        "recovered at open",
        format!("{} blocks, {} torn, {} foreign", s.recovered_blocks, s.recovered_torn, s.recovered_foreign),
    );
    t
}

#[cfg(test)]
// TierStats is non-exhaustive: a test value is built field by field.
#[allow(clippy::field_reassign_with_default)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_gb_per_second_between_readings() {
        let mut prev = TierStats::default();
        prev.bytes_saved = 1_000_000_000;
        let mut now = TierStats::default();
        now.bytes_saved = 5_000_000_000;
        now.bytes_restored = 2_000_000_000;
        assert_eq!(rates(&prev, &now, Duration::from_secs(2)), (2.0, 1.0));
        assert_eq!(rates(&now, &prev, Duration::from_secs(2)), (0.0, 0.0), "a counter that went back is 0");
        assert_eq!(rates(&prev, &now, Duration::ZERO), (0.0, 0.0));
    }

    #[test]
    fn the_clients_table_has_a_row_a_process_and_caps_at_top_clients() {
        assert!(clients_table(&[]).contains("none"));
        let rows: Vec<ClientStats> = (0..12u32)
            .map(|i| {
                let mut c = ClientStats::default();
                c.pid = Some(1000 + i);
                c.bytes_saved = 2_500_000_000;
                c
            })
            .collect();
        let t = clients_table(&rows);
        assert!(t.contains("top clients (12 processes)"), "{t}");
        assert!(t.contains("1009") && !t.contains("1010"), "ten rows: {t}");
        assert!(t.contains("2.500"), "saved GB: {t}");
        assert!(t.contains("... 2 more"), "{t}");
    }

    #[test]
    fn hit_ratio_is_hits_over_lookups() {
        assert_eq!(hit_ratio(&TierStats::default()), 0.0);
        let mut s = TierStats::default();
        s.hit_blocks = 3;
        s.miss_blocks = 1;
        assert_eq!(hit_ratio(&s), 0.75);
    }
}

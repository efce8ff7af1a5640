//! Size arguments: byte sizes through [`kvtier::parse_bytes`] (`4GiB`, `512MiB`, `32GB`,
//! `34.5MB`; GB = 10^9 B, GiB = 2^30 B; units are case-sensitive, so `4gb` is refused with both
//! readings), plus pool sizes given in slots (`9952slots`) on top of it.

use crate::error::Error;

/// Parses a byte size with an optional unit (`4GiB`, `512MiB`, `32GB`, `1.5TB`, `4096`), as
/// [`kvtier::parse_bytes`].
///
/// # Errors
/// The [`kvtier::SizeError`]'s message: it names the input and the accepted units (it is what
/// clap prints for `--pool`).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    kvtier::parse_bytes(s).map_err(|e| e.to_string())
}

/// Parses an SSD tier file given as `PATH:SIZE` (`/mnt/nvme0/kvtier.ssd:2TiB`; the path ends at
/// the last colon), as [`kvtier::parse_ssd_file`].
///
/// # Errors
/// The [`kvtier::SizeError`]'s message (what clap prints for `--ssd`).
pub fn parse_ssd_file(s: &str) -> Result<kvtier::SsdFile, String> {
    kvtier::parse_ssd_file(s).map_err(|e| e.to_string())
}

/// Parses a pool size into whole slots of `slot_bytes` bytes: a slot count with the suffix `slots`
/// (`9952slots`), or a byte size as [`parse_bytes`], which holds the slots the pool would map
/// ([`kvtier::PoolConfig::slots`]: `32GiB` of 3,452,160 B slots is 9,953).
///
/// # Errors
/// [`Error::Config`] for a bad number or unit (with the size parser's reason), or a size below one
/// slot or above [`kvtier::MAX_SLOTS`] slots.
pub fn parse_slots(s: &str, slot_bytes: u64) -> Result<u32, Error> {
    let t = s.trim();
    let bad = |why: String| Error::Config(format!("bad pool size `{s}` (e.g. 32GiB, 500MB, 9952slots): {why}"));
    let out_of_range = |slots: u64| {
        Error::Config(format!(
            "pool size `{s}` is {slots} slots of {slot_bytes} B; it must hold 1 to {} slots",
            kvtier::MAX_SLOTS
        ))
    };
    let slots: u64 = match t.strip_suffix("slots") {
        Some(n) => n.trim().parse().map_err(|e| bad(format!("{e}")))?,
        None => {
            let bytes = kvtier::parse_bytes(t).map_err(|e| bad(e.to_string()))?;
            return kvtier::PoolConfig::new(bytes).slots(slot_bytes).map_err(|e| match e {
                kvtier::PoolError::TooSmall { .. } => out_of_range(0),
                kvtier::PoolError::TooManySlots { slots, .. } => out_of_range(slots),
                e => Error::Config(format!("pool size `{s}`: {e}")),
            });
        }
    };
    if slots == 0 || slots > kvtier::MAX_SLOTS as u64 {
        return Err(out_of_range(slots));
    }
    Ok(slots as u32)
}

/// Parses an SSD tier size into whole disk slots of `geometry`: a slot count with the suffix
/// `slots` (`636857slots`), or a byte size as [`parse_bytes`], which holds the slots an SSD slot
/// file of that size would ([`kvtier::Geometry::disk_slots`]: `2TiB` of `glm52` blocks is 636,857).
///
/// # Errors
/// [`Error::Config`] for a bad number or unit (with the size parser's reason), or a size below one
/// disk slot or above [`kvtier::MAX_SLOTS`] slots.
pub fn parse_disk_slots(s: &str, geometry: &kvtier::Geometry) -> Result<u32, Error> {
    let t = s.trim();
    let bad = |why: String| Error::Config(format!("bad SSD size `{s}` (e.g. 512GiB, 2TB, 636857slots): {why}"));
    let slots: u64 = match t.strip_suffix("slots") {
        Some(n) => n.trim().parse().map_err(|e| bad(format!("{e}")))?,
        None => geometry.disk_slots(kvtier::parse_bytes(t).map_err(|e| bad(e.to_string()))?),
    };
    if slots == 0 || slots > kvtier::MAX_SLOTS as u64 {
        return Err(Error::Config(format!(
            "SSD size `{s}` is {slots} disk slots of {} B (after the file's 4 KiB header); it must hold 1 to {} slots",
            geometry.disk_slot_bytes(),
            kvtier::MAX_SLOTS
        )));
    }
    Ok(slots as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_with_units() {
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("32GB"), Ok(32_000_000_000));
        assert_eq!(parse_bytes("34.52216MB"), Ok(34_522_160));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes(" 2 GiB "), Ok(2 << 30));
        let e = parse_bytes("lots").unwrap_err();
        assert!(e.starts_with("`lots` is not a byte size"), "{e}");
        let e = parse_bytes("4gb").unwrap_err();
        assert!(e.contains("did you mean 4GB (4000000000 B) or 4GiB (4294967296 B)?"), "{e}");
    }

    #[test]
    fn slots_from_bytes_or_counts() {
        let slot = 3_452_160; // one GLM-5.2 block
                              // What the pool maps (sizes this machine can map without a prefault), the one computation.
        for size in ["8GiB", "34.52216MB"] {
            let cfg =
                kvtier::PoolConfig::new(kvtier::parse_bytes(size).unwrap()).with_backing(kvtier::BackingChoice::Plain);
            let pool = kvtier::HostPool::new(slot, &cfg).unwrap();
            assert_eq!(parse_slots(size, slot).unwrap(), pool.capacity(), "{size}");
        }
        assert_eq!(parse_slots("32GiB", slot).unwrap(), 9953);
        assert_eq!(parse_slots("8GiB", slot).unwrap(), 2488);
        assert_eq!(parse_slots("64GiB", slot).unwrap(), 19_906);
        assert_eq!(parse_slots("34.52216MB", slot).unwrap(), 10);
        assert_eq!(parse_slots("9952slots", slot).unwrap(), 9952);
        assert_eq!(parse_slots(" 7 slots", slot).unwrap(), 7);
        let msg = |s: &str| parse_slots(s, slot).unwrap_err().to_string();
        let max = kvtier::MAX_SLOTS;
        assert_eq!(
            msg("1MiB"),
            format!("invalid configuration: pool size `1MiB` is 0 slots of 3452160 B; it must hold 1 to {max} slots")
        );
        assert_eq!(
            msg("0slots"),
            format!("invalid configuration: pool size `0slots` is 0 slots of 3452160 B; it must hold 1 to {max} slots")
        );
        assert!(msg("12 parsecs")
            .starts_with("invalid configuration: bad pool size `12 parsecs` (e.g. 32GiB, 500MB, 9952slots): "));
        assert!(msg("4gb").contains("did you mean 4GB"), "{}", msg("4gb"));
        assert!(msg("1.5slots")
            .starts_with("invalid configuration: bad pool size `1.5slots` (e.g. 32GiB, 500MB, 9952slots): "));
    }

    #[test]
    fn disk_slots_from_bytes_or_counts() {
        let g = kvtier::Geometry::preset("glm52", 1).unwrap();
        // 4 KiB of header, then slots of 3,452,928 B (the 3,452,160 B block, its trailer, 4 KiB pages).
        assert_eq!(parse_disk_slots("2TiB", &g).unwrap(), 636_857);
        assert_eq!(parse_disk_slots("512GiB", &g).unwrap(), 159_214);
        assert_eq!(parse_disk_slots("128GiB", &g).unwrap(), 39_803);
        assert_eq!(parse_disk_slots("3457024", &g).unwrap(), 1); // 4,096 + 3,452,928 B
        assert_eq!(parse_disk_slots("1000slots", &g).unwrap(), 1000);
        let msg = |s: &str| parse_disk_slots(s, &g).unwrap_err().to_string();
        assert_eq!(
            msg("3MB"),
            format!(
                "invalid configuration: SSD size `3MB` is 0 disk slots of 3452928 B (after the file's 4 KiB header); \
                 it must hold 1 to {} slots",
                kvtier::MAX_SLOTS
            )
        );
        assert!(msg("2tb").contains("did you mean 2TB"), "{}", msg("2tb"));
    }
}

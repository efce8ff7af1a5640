//! Size arguments: byte sizes through the `parse-size` crate (`4GiB`, `512MiB`, `32GB`, `34.5MB`;
//! GB = 10^9 B, GiB = 2^30 B; units are case-insensitive), plus pool sizes given in slots
//! (`9952slots`) on top of it.

use crate::error::Error;

/// Parses a byte size with an optional unit (`4GiB`, `512MiB`, `32GB`, `1.5TB`, `4096`).
///
/// # Errors
/// A message naming the input and an example, for an unknown unit, a bad number or an overflow
/// (it is what clap prints for `--pool`).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_size::parse_size(s.trim()).map_err(|e| format!("`{s}` is not a byte size (e.g. 4GiB, 512MiB, 32GB): {e}"))
}

/// Parses a pool size into whole slots of `slot_bytes` bytes: a slot count with the suffix `slots`
/// (`9952slots`), or a byte size as [`parse_bytes`] (`32GiB` holds `floor(bytes / slot_bytes)`
/// slots).
///
/// # Errors
/// [`Error::Config`] for a bad number or unit, or a size below one slot or above
/// [`kvtier::MAX_SLOTS`] slots.
pub fn parse_slots(s: &str, slot_bytes: u64) -> Result<u32, Error> {
    let t = s.trim();
    let bad = || Error::Config(format!("bad pool size `{s}` (e.g. 32GiB, 500MB, 9952slots)"));
    let slots: u64 = match t.strip_suffix("slots") {
        Some(n) => n.trim().parse().map_err(|_| bad())?,
        None => parse_bytes(t).map_err(|_| bad())? / slot_bytes.max(1),
    };
    if slots == 0 || slots > kvtier::MAX_SLOTS as u64 {
        return Err(Error::Config(format!(
            "pool size `{s}` is {slots} slots of {slot_bytes} B; it must hold 1 to {} slots",
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
        assert_eq!(parse_bytes(" 2 gib "), Ok(2 << 30));
        let e = parse_bytes("lots").unwrap_err();
        assert!(e.starts_with("`lots` is not a byte size (e.g. 4GiB, 512MiB, 32GB): "), "{e}");
    }

    #[test]
    fn slots_from_bytes_or_counts() {
        let slot = 3_452_160; // one GLM-5.2 block
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
        assert_eq!(
            msg("12 parsecs"),
            "invalid configuration: bad pool size `12 parsecs` (e.g. 32GiB, 500MB, 9952slots)"
        );
        assert_eq!(msg("1.5slots"), "invalid configuration: bad pool size `1.5slots` (e.g. 32GiB, 500MB, 9952slots)");
    }
}

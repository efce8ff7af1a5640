//! Byte sizes with units, as a person writes them on a command line ([`parse_bytes`]): one parser
//! for `kvtierd --pool`, the `kvtier` command line and the examples, so `4GB` means the same
//! everywhere and a unit that could be read two ways is refused, never guessed. [`parse_ssd_file`]
//! reads an SSD tier file as `PATH:SIZE` with it (`kvtierd --ssd`, `kvtier replay --ssd`).

use crate::error::SizeError;
use crate::tier::ssd::SsdFile;

/// The units [`parse_bytes`] accepts, each with its bytes, spelled exactly so.
const UNITS: [(&str, u64); 11] = [
    ("B", 1),
    ("kB", 1_000),
    ("KB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
    ("", 1),
];

/// Parses a byte size: a number (`4096`, `1.5`) with an optional unit, spaces allowed around and
/// between: `B`; decimal `kB` (or `KB`), `MB`, `GB`, `TB` (10^3, 10^6, 10^9, 10^12 B: GB = 10^9 B);
/// binary `KiB`, `MiB`, `GiB`, `TiB` (2^10, 2^20, 2^30, 2^40 B). Units are case-sensitive: `4gb`,
/// `4G` or `4gib` could mean either kind and are refused with both readings in the message.
/// A fraction must come to whole bytes (`34.52216MB` is 34,522,160 B; `1.5B` is refused).
///
/// # Errors
/// [`SizeError::Number`] (no number), [`SizeError::Unit`] (an unknown or ambiguous unit, naming
/// the accepted forms), [`SizeError::Fraction`] (not whole bytes), [`SizeError::Overflow`] (more
/// than `u64::MAX` bytes).
pub fn parse_bytes(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = (&t[..split], t[split..].trim());
    let number_error = || SizeError::Number { input: s.to_string() };
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') {
        return Err(number_error());
    }
    let any_case = crate::seeded::seeded("size-unit-any-case");
    let Some(&(_, mult)) = UNITS.iter().find(|(name, _)| *name == unit || any_case && name.eq_ignore_ascii_case(unit))
    else {
        return Err(unit_error(s, number, unit));
    };
    let overflow = || SizeError::Overflow { input: s.to_string() };
    let int: u128 = if int.is_empty() { 0 } else { int.parse().map_err(|_| overflow())? };
    // value = (int + frac / 10^digits) * mult, exactly (u128: 20 + 13 digits fit; more is overflow).
    if frac.len() > 24 {
        return Err(SizeError::Fraction { input: s.to_string() });
    }
    let scale = 10u128.pow(frac.len() as u32);
    let frac: u128 = if frac.is_empty() { 0 } else { frac.parse().map_err(|_| number_error())? };
    let whole = int.checked_mul(mult as u128).ok_or_else(overflow)?;
    let part = frac * mult as u128;
    if part % scale != 0 {
        return Err(SizeError::Fraction { input: s.to_string() });
    }
    let bytes = whole.checked_add(part / scale).ok_or_else(overflow)?;
    u64::try_from(bytes).map_err(|_| overflow())
}

/// Parses an SSD tier file as a command line gives it: `PATH:SIZE`, the file's path, a colon, and
/// the bytes it may take as [`parse_bytes`] reads them (`/mnt/nvme0/kvtier.ssd:2TiB`). The path
/// ends at the last colon, so a path may hold colons; a size never does. The file holds
/// [`crate::Geometry::disk_slots`]`(bytes)` blocks (see [`SsdFile::bytes`]).
///
/// # Errors
/// [`SizeError::PathAndSize`] for no colon, or nothing before it; the [`parse_bytes`] errors of
/// the size.
pub fn parse_ssd_file(s: &str) -> Result<SsdFile, SizeError> {
    let not_path_and_size = || SizeError::PathAndSize { input: s.to_string() };
    // Seeded bug (tests only): the path ends at the first colon, not the last.
    let split = if crate::seeded::seeded("ssd-flag-first-colon") { s.split_once(':') } else { s.rsplit_once(':') };
    let (path, size) = split.ok_or_else(not_path_and_size)?;
    if path.trim().is_empty() {
        return Err(not_path_and_size());
    }
    Ok(SsdFile { path: path.into(), bytes: parse_bytes(size)? })
}

/// The error for `unit`: with both readings of `number` when the unit is a known one in another
/// case or without its `B` (`gb`, `G`, `gib`).
fn unit_error(input: &str, number: &str, unit: &str) -> SizeError {
    let letter = unit.chars().next().map(|c| c.to_ascii_uppercase());
    let prefix = match letter {
        Some(c @ ('K' | 'M' | 'G' | 'T')) if unit.len() <= 3 && unit[1..].chars().all(|c| "iIbB".contains(c)) => {
            Some(c)
        }
        _ => None,
    };
    let readings = prefix.and_then(|p| {
        let dec = if p == 'K' { "kB".to_string() } else { format!("{p}B") };
        let bin = format!("{p}iB");
        let as_bytes = |u: &str| parse_bytes(&format!("{number}{u}")).ok();
        Some(format!("; did you mean {number}{dec} ({} B) or {number}{bin} ({} B)?", as_bytes(&dec)?, as_bytes(&bin)?))
    });
    SizeError::Unit { input: input.to_string(), unit: unit.to_string(), readings: readings.unwrap_or_default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_and_binary_units() {
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("32GB"), Ok(32_000_000_000));
        assert_eq!(parse_bytes("4 GB"), Ok(4_000_000_000));
        assert_eq!(parse_bytes("34.52216MB"), Ok(34_522_160));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("4096B"), Ok(4096));
        assert_eq!(parse_bytes("8kB"), Ok(8000));
        assert_eq!(parse_bytes("8KB"), Ok(8000));
        assert_eq!(parse_bytes("2KiB"), Ok(2048));
        assert_eq!(parse_bytes("1TiB"), Ok(1 << 40));
        assert!(parse_bytes("16EiB").unwrap_err().to_string().contains("unknown or ambiguous unit `EiB`"));
        assert_eq!(parse_bytes(" 7 "), Ok(7));
    }

    #[test]
    fn an_ambiguous_unit_is_refused_with_both_readings() {
        let e = parse_bytes("4gb").unwrap_err();
        assert_eq!(
            e,
            SizeError::Unit {
                input: "4gb".into(),
                unit: "gb".into(),
                readings: "; did you mean 4GB (4000000000 B) or 4GiB (4294967296 B)?".into()
            }
        );
        assert_eq!(
            e.to_string(),
            "`4gb`: unknown or ambiguous unit `gb` (accepted: bytes, B, kB, MB, GB, TB = 10^3..10^12 B, \
             KiB, MiB, GiB, TiB = 2^10..2^40 B; units are case-sensitive); did you mean 4GB (4000000000 B) \
             or 4GiB (4294967296 B)?"
        );
        for s in ["4G", "4gib", "4Gb", "2 mb", "3k"] {
            let e = parse_bytes(s).unwrap_err().to_string();
            assert!(e.contains("did you mean"), "{s}: {e}");
        }
        let e = parse_bytes("12 parsecs").unwrap_err();
        assert!(
            matches!(&e, SizeError::Unit { unit, readings, .. } if unit == "parsecs" && readings.is_empty()),
            "{e:?}"
        );
    }

    #[test]
    fn an_ssd_file_is_a_path_and_a_size_split_at_the_last_colon() {
        let f = parse_ssd_file("/mnt/nvme0/kvtier.ssd:2TiB").unwrap();
        assert_eq!((f.path, f.bytes), ("/mnt/nvme0/kvtier.ssd".into(), 2 << 40));
        let f = parse_ssd_file("dir/a:b.ssd:36KiB").unwrap();
        assert_eq!((f.path, f.bytes), ("dir/a:b.ssd".into(), 36 << 10));
        for bad in ["/mnt/nvme0/kvtier.ssd", ":2TiB", " :4096", ""] {
            assert_eq!(parse_ssd_file(bad), Err(SizeError::PathAndSize { input: bad.into() }), "{bad}");
        }
        assert_eq!(
            parse_ssd_file("x.ssd:2TB").map(|f| f.bytes),
            Ok(2_000_000_000_000),
            "the size as parse_bytes reads it"
        );
        assert_eq!(parse_ssd_file("x.ssd:lots"), Err(SizeError::Number { input: "lots".into() }));
        let e = parse_ssd_file("x.ssd").unwrap_err().to_string();
        assert!(e.contains("`x.ssd` is not PATH:SIZE"), "{e}");
    }

    #[test]
    fn bad_numbers_fractions_and_overflow_are_typed() {
        assert_eq!(parse_bytes("lots"), Err(SizeError::Number { input: "lots".into() }));
        assert_eq!(parse_bytes(""), Err(SizeError::Number { input: "".into() }));
        assert_eq!(parse_bytes("1.2.3GB"), Err(SizeError::Number { input: "1.2.3GB".into() }));
        assert_eq!(parse_bytes("1.5"), Err(SizeError::Fraction { input: "1.5".into() }));
        assert_eq!(parse_bytes("0.1B"), Err(SizeError::Fraction { input: "0.1B".into() }));
        assert_eq!(parse_bytes("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(
            parse_bytes("18446744073709551616"),
            Err(SizeError::Overflow { input: "18446744073709551616".into() })
        );
        assert_eq!(parse_bytes("17000000TiB"), Err(SizeError::Overflow { input: "17000000TiB".into() }));
    }
}

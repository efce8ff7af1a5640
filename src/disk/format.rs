//! The on-disk format of a disk slot file: one 4 KiB file header, then fixed-size slots, each a
//! block's payload followed by padding whose last [`TRAILER_BYTES`] hold a self-describing trailer.
//!
//! ```text
//! offset 0                 4096              4096 + stride        4096 + 2 * stride
//! | file header (4 KiB)    | slot 0                     | slot 1                     | ...
//!                          | payload ... | pad | trailer | payload ... | pad | trailer |
//! stride = align_up(payload_bytes + TRAILER_BYTES, 4096)
//! ```
//!
//! Every multi-byte field is little-endian. The file header and each trailer carry an XXH3-64
//! checksum of their own preceding bytes; a trailer also carries the XXH3-64 of its payload, so a
//! slot whose write was torn (any mix of old and new pages) fails one of the two checks and is
//! treated as free. A GLM-5.2 block of 3,452,160 B takes a stride of 3,452,928 B (843 pages of
//! 4 KiB; 768 B of padding, the trailer included).

use xxhash_rust::xxh3::xxh3_64;

use crate::key::{ContentKey, Namespace};

/// The unit of O_DIRECT I/O and of the layout: offsets and lengths are multiples of it (bytes).
pub const DISK_PAGE: usize = 4096;
/// Bytes of a slot trailer, at the end of each slot's last page.
pub const TRAILER_BYTES: usize = 96;
/// Bytes of the file header (the first page of the file).
pub(crate) const HEADER_BYTES: usize = DISK_PAGE;

const FILE_MAGIC: [u8; 8] = *b"KVTIERSD";
const SLOT_MAGIC: [u8; 8] = *b"KVTSLOT1";
/// Version of the file header and trailer layout; a file of another version is refused.
pub const FORMAT_VERSION: u32 = 1;

/// Rounds `bytes` up to a multiple of [`DISK_PAGE`]; `None` on overflow.
pub(crate) fn align_up_page(bytes: u64) -> Option<u64> {
    let page = DISK_PAGE as u64;
    bytes.checked_add(page - 1).map(|b| b / page * page)
}

/// Bytes one slot takes on disk for a payload of `payload_bytes`: the payload and the trailer,
/// rounded up to 4 KiB. `None` when it overflows `u64`.
pub fn slot_stride(payload_bytes: u64) -> Option<u64> {
    align_up_page(payload_bytes.checked_add(TRAILER_BYTES as u64)?)
}

/// What the first page of a disk slot file says about the file: the geometry it was made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileHeader {
    /// The namespace (model and layout) whose blocks the file holds.
    pub namespace: Namespace,
    /// Bytes of one block's payload (the host pool's slot size).
    pub payload_bytes: u64,
    /// Bytes between two slots on disk ([`slot_stride`] of `payload_bytes`).
    pub stride: u64,
    /// Number of slots in the file.
    pub slots: u64,
}

/// Why a file header or a slot trailer was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatFault {
    /// Every byte is zero: never written (a fresh slot, or one cleared on purpose).
    Blank,
    /// The magic bytes are not kvtier's: not a kvtier file or slot.
    BadMagic,
    /// A layout version this build does not read.
    BadVersion(u32),
    /// The checksum over the header or trailer does not match: a torn or corrupted write.
    BadChecksum,
}

impl std::fmt::Display for FormatFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FormatFault::Blank => write!(f, "all zero (never written)"),
            FormatFault::BadMagic => write!(f, "magic bytes are not kvtier's"),
            FormatFault::BadVersion(v) => write!(f, "format version {v}, this build reads {FORMAT_VERSION}"),
            FormatFault::BadChecksum => write!(f, "checksum mismatch (torn or corrupted)"),
        }
    }
}

fn put(out: &mut [u8], at: &mut usize, bytes: &[u8]) {
    out[*at..*at + bytes.len()].copy_from_slice(bytes);
    *at += bytes.len();
}

fn take<const N: usize>(bytes: &[u8], at: &mut usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[*at..*at + N]);
    *at += N;
    out
}

/// Checks magic, version and the trailing checksum of a `len`-byte record whose first 8 bytes are
/// `magic`, next 4 the version, and last 8 the XXH3-64 of everything before them.
fn check_record(bytes: &[u8], len: usize, magic: &[u8; 8]) -> Result<(), FormatFault> {
    let record = &bytes[..len];
    if record.iter().all(|&b| b == 0) {
        return Err(FormatFault::Blank);
    }
    if &record[..8] != magic {
        return Err(FormatFault::BadMagic);
    }
    let version = u32::from_le_bytes(record[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(FormatFault::BadVersion(version));
    }
    let stored = u64::from_le_bytes(record[len - 8..].try_into().expect("8 bytes"));
    let skip_checksum = crate::seeded::seeded("disk-trailer-unchecked") && magic == &SLOT_MAGIC;
    if !skip_checksum && xxh3_64(&record[..len - 8]) != stored {
        return Err(FormatFault::BadChecksum);
    }
    Ok(())
}

// Header layout: magic 8 | version 4 | reserved 4 | namespace 16 | payload_bytes 8 | stride 8 |
// slots 8 | ... zero ... | checksum 8 (the last 8 bytes of the 4 KiB page).
impl FileHeader {
    /// Writes the header into the first page of the file (`out` is at least [`HEADER_BYTES`]).
    pub fn encode(&self, out: &mut [u8]) {
        let out = &mut out[..HEADER_BYTES];
        out.fill(0);
        let mut at = 0;
        put(out, &mut at, &FILE_MAGIC);
        put(out, &mut at, &FORMAT_VERSION.to_le_bytes());
        put(out, &mut at, &0u32.to_le_bytes());
        put(out, &mut at, self.namespace.as_bytes());
        put(out, &mut at, &self.payload_bytes.to_le_bytes());
        put(out, &mut at, &self.stride.to_le_bytes());
        put(out, &mut at, &self.slots.to_le_bytes());
        let sum = xxh3_64(&out[..HEADER_BYTES - 8]);
        out[HEADER_BYTES - 8..].copy_from_slice(&sum.to_le_bytes());
    }

    /// Reads a header from the first page of a file (`bytes` is at least [`HEADER_BYTES`]).
    ///
    /// # Errors
    /// The [`FormatFault`] of a page that is not a kvtier header of this version, or is torn.
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatFault> {
        check_record(bytes, HEADER_BYTES, &FILE_MAGIC)?;
        let mut at = 16;
        let namespace = Namespace::from_bytes(take::<16>(bytes, &mut at));
        let payload_bytes = u64::from_le_bytes(take::<8>(bytes, &mut at));
        let stride = u64::from_le_bytes(take::<8>(bytes, &mut at));
        let slots = u64::from_le_bytes(take::<8>(bytes, &mut at));
        Ok(FileHeader { namespace, payload_bytes, stride, slots })
    }

    /// Byte offset of `slot` in the file.
    pub fn slot_offset(&self, slot: u64) -> u64 {
        HEADER_BYTES as u64 + slot * self.stride
    }

    /// Bytes of the whole file: the header and every slot.
    pub fn file_bytes(&self) -> Option<u64> {
        self.slots.checked_mul(self.stride)?.checked_add(HEADER_BYTES as u64)
    }
}

/// The self-describing trailer at the end of a disk slot: which block the slot holds and the
/// checksum of its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotTrailer {
    /// The namespace the block belongs to.
    pub namespace: Namespace,
    /// The block's content key.
    pub key: ContentKey,
    /// The slot this trailer was written for (a trailer copied to another slot is refused).
    pub slot: u64,
    /// The disk slot's generation: one more on every write of the slot.
    pub generation: u64,
    /// Bytes of the payload the checksum covers.
    pub payload_bytes: u64,
    /// XXH3-64 of the payload.
    pub payload_xxh3: u64,
}

// Trailer layout (96 B): magic 8 | version 4 | reserved 4 | namespace 16 | key 16 | slot 8 |
// generation 8 | payload_bytes 8 | payload_xxh3 8 | reserved 8 | checksum 8.
impl SlotTrailer {
    /// Encodes the trailer into `out` (exactly [`TRAILER_BYTES`]).
    pub fn encode(&self, out: &mut [u8]) {
        let out = &mut out[..TRAILER_BYTES];
        out.fill(0);
        let mut at = 0;
        put(out, &mut at, &SLOT_MAGIC);
        put(out, &mut at, &FORMAT_VERSION.to_le_bytes());
        put(out, &mut at, &0u32.to_le_bytes());
        put(out, &mut at, self.namespace.as_bytes());
        put(out, &mut at, self.key.as_bytes());
        put(out, &mut at, &self.slot.to_le_bytes());
        put(out, &mut at, &self.generation.to_le_bytes());
        put(out, &mut at, &self.payload_bytes.to_le_bytes());
        put(out, &mut at, &self.payload_xxh3.to_le_bytes());
        let sum = xxh3_64(&out[..TRAILER_BYTES - 8]);
        out[TRAILER_BYTES - 8..].copy_from_slice(&sum.to_le_bytes());
    }

    /// Decodes a trailer from `bytes` (at least [`TRAILER_BYTES`]).
    ///
    /// # Errors
    /// The [`FormatFault`] of bytes that are blank, not a trailer of this version, or torn.
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatFault> {
        check_record(bytes, TRAILER_BYTES, &SLOT_MAGIC)?;
        let mut at = 16;
        let namespace = Namespace::from_bytes(take::<16>(bytes, &mut at));
        let key = ContentKey::from_bytes(take::<16>(bytes, &mut at));
        let slot = u64::from_le_bytes(take::<8>(bytes, &mut at));
        let generation = u64::from_le_bytes(take::<8>(bytes, &mut at));
        let payload_bytes = u64::from_le_bytes(take::<8>(bytes, &mut at));
        let payload_xxh3 = u64::from_le_bytes(take::<8>(bytes, &mut at));
        Ok(SlotTrailer { namespace, key, slot, generation, payload_bytes, payload_xxh3 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trailer() -> SlotTrailer {
        SlotTrailer {
            namespace: Namespace::from_description(b"glm-5.2 test"),
            key: ContentKey::from_words(7, 9),
            slot: 12,
            generation: 3,
            payload_bytes: 3_452_160,
            payload_xxh3: 0xdead_beef,
        }
    }

    #[test]
    fn a_glm52_block_takes_843_pages() {
        assert_eq!(slot_stride(3_452_160), Some(843 * 4096));
        assert_eq!(slot_stride(4096 - TRAILER_BYTES as u64), Some(4096));
        assert_eq!(slot_stride(4096 - TRAILER_BYTES as u64 + 1), Some(8192));
        assert_eq!(slot_stride(u64::MAX - 10), None);
    }

    #[test]
    fn a_trailer_round_trips_and_any_flipped_byte_is_refused() {
        let t = trailer();
        let mut bytes = [0u8; TRAILER_BYTES];
        t.encode(&mut bytes);
        assert_eq!(SlotTrailer::decode(&bytes), Ok(t));
        for i in 0..TRAILER_BYTES {
            let mut torn = bytes;
            torn[i] ^= 0x10;
            let got = SlotTrailer::decode(&torn);
            assert!(got.is_err(), "a flip of byte {i} was accepted: {got:?}");
        }
        assert_eq!(SlotTrailer::decode(&[0u8; TRAILER_BYTES]), Err(FormatFault::Blank));
    }

    #[test]
    fn a_header_round_trips_and_refuses_other_files() {
        let h =
            FileHeader { namespace: Namespace::from_description(b"ns"), payload_bytes: 4000, stride: 4096, slots: 10 };
        let mut page = vec![0u8; HEADER_BYTES];
        h.encode(&mut page);
        assert_eq!(FileHeader::decode(&page), Ok(h));
        assert_eq!(h.slot_offset(2), 4096 + 2 * 4096);
        assert_eq!(h.file_bytes(), Some(11 * 4096));
        let mut other = page.clone();
        other[..8].copy_from_slice(b"NOTKVTIE");
        assert_eq!(FileHeader::decode(&other), Err(FormatFault::BadMagic));
        let mut newer = page.clone();
        newer[8] = 2;
        assert_eq!(FileHeader::decode(&newer), Err(FormatFault::BadVersion(2)));
        let mut torn = page;
        torn[40] ^= 1;
        assert_eq!(FileHeader::decode(&torn), Err(FormatFault::BadChecksum));
    }
}

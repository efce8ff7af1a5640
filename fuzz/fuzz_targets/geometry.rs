//! `Geometry::new` and `ArenaBinding::new` on arbitrary numbers: never panic; an accepted geometry
//! has a monotone, aligned slot layout holding every chunk; an accepted binding has aligned non-null
//! bases whose arenas share no byte (checked on the first and last pages of each pair).
#![no_main]

use kvtier::{COPY_ALIGN, SLOT_CHUNK_ALIGN};
use kvtier::{ArenaBinding, ArenaSpec, Geometry, Placement};
use libfuzzer_sys::fuzz_target;

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }
    fn u64(&mut self) -> u64 {
        // A small tag picks the magnitude so interesting values are common.
        match self.u8() % 4 {
            0 => self.u8() as u64 * 16,
            1 => self.u8() as u64,
            2 => (1u64 << (self.u8() % 64)).wrapping_sub(self.u8() as u64 % 3),
            _ => (0..8).fold(0u64, |acc, _| acc << 8 | self.u8() as u64),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let n = inp.u8() as usize % 6;
    let page_tokens = inp.u8() as u32;
    let model = if inp.u8() % 8 == 0 { "" } else { "m" };
    let mut arenas = Vec::new();
    for i in 0..n {
        let name = if inp.u8() % 16 == 0 {
            String::new()
        } else {
            {
                let _ = i;
                format!("a{}", inp.u8() % 8)
            }
        };
        let bytes_per_page = inp.u64();
        let page_stride = if inp.u8() % 2 == 0 { bytes_per_page } else { inp.u64() };
        let pages = inp.u64();
        let placement = if inp.u8() % 3 == 0 {
            Placement::Fused { buffer: inp.u8() as u32 % 2, offset: inp.u64() }
        } else {
            Placement::Own
        };
        arenas.push(ArenaSpec { name, bytes_per_page, page_stride, pages, placement });
    }
    let Ok(g) = Geometry::new(model, page_tokens, arenas.clone()) else { return };
    // Accepted: the documented invariants hold.
    assert!(!arenas.is_empty() && page_tokens > 0 && !model.is_empty());
    let mut end = 0u64;
    for (a, &off) in arenas.iter().zip(g.chunk_offsets()) {
        assert!(a.bytes_per_page > 0 && a.bytes_per_page % COPY_ALIGN == 0);
        assert!(a.page_stride >= a.bytes_per_page && a.page_stride % COPY_ALIGN == 0 && a.pages > 0);
        assert_eq!(off % SLOT_CHUNK_ALIGN, 0);
        assert!(off >= end);
        end = off + a.bytes_per_page;
    }
    assert_eq!(g.slot_bytes(), end.div_ceil(SLOT_CHUNK_ALIGN) * SLOT_CHUNK_ALIGN);
    assert!(g.slot_bytes() >= g.block_bytes());
    assert_eq!(g.pages(), arenas.iter().map(|a| a.pages).min().unwrap());
    assert_eq!(g.with_pages(g.pages()).map(|h| h.namespace()), Ok(g.namespace()));
    // Bindings of the accepted geometry.
    let bases: Vec<u64> = (0..arenas.len()).map(|_| inp.u64()).collect();
    let Ok(b) = ArenaBinding::new(&g, bases.clone()) else { return };
    assert_eq!(b.bases(), bases.as_slice());
    for (i, (a, &x)) in arenas.iter().zip(&bases).enumerate() {
        assert!(x != 0 && x % COPY_ALIGN == 0 && x.checked_add(a.extent()).is_some());
        for (c, &y) in arenas.iter().zip(&bases).skip(i + 1) {
            for p in [0, a.pages - 1] {
                for q in [0, c.pages - 1] {
                    let (s1, s2) = (x + p * a.page_stride, y + q * c.page_stride);
                    assert!(
                        s1 + a.bytes_per_page <= s2 || s2 + c.bytes_per_page <= s1,
                        "accepted binding: page {p} of an arena at {x:#x} overlaps page {q} of one at {y:#x}"
                    );
                }
            }
        }
    }
});

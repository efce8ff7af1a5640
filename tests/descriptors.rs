//! CPU check (runs in CI): the Rust descriptor structs match the CUDA ones in
//! `cuda/kvtier_copy.cuh` field by field (names, order, C types, offsets) and in size, and the
//! constants agree. Parses the header text, so it needs no GPU and no CUDA toolkit.

use std::collections::HashMap;

const HEADER: &str = include_str!("../cuda/kvtier_copy.cuh");

/// (name, type, array length) of each field of `struct NAME { ... };` in the header.
fn fields(name: &str) -> Vec<(String, String, usize)> {
    let start = HEADER.find(&format!("struct {name} {{")).unwrap_or_else(|| panic!("struct {name} not in header"));
    let body = &HEADER[start..];
    let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
    body.lines()
        .map(|l| l.split("//").next().unwrap().trim())
        .filter(|l| !l.is_empty())
        .map(|l| {
            let l = l.trim_end_matches(';').trim_start_matches("struct ");
            let mut it = l.split_whitespace();
            let ty = it.next().unwrap().to_string();
            let decl = it.next().unwrap();
            let (n, len) = match decl.split_once('[') {
                Some((n, rest)) => (n.to_string(), defines()[rest.trim_end_matches(']')] as usize),
                None => (decl.to_string(), 1),
            };
            (n, ty, len)
        })
        .collect()
}

fn defines() -> HashMap<String, u64> {
    HEADER
        .lines()
        .filter_map(|l| l.strip_prefix("#define "))
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let n = it.next()?;
            let v = it.next()?.trim_end_matches('u');
            v.parse().ok().map(|v| (n.to_string(), v))
        })
        .collect()
}

/// C layout of a field list: offsets and total size.
fn layout(f: &[(String, String, usize)]) -> (Vec<(String, usize)>, usize) {
    let size_align = |t: &str| -> (usize, usize) {
        match t {
            "kvt_u64" => (8, 8),
            "kvt_u32" => (4, 4),
            "kvt_pair" => (16, 8),
            other => panic!("unknown type {other}"),
        }
    };
    let mut off = 0usize;
    let mut max_align = 1usize;
    let mut out = Vec::new();
    for (n, t, len) in f {
        let (s, a) = size_align(t);
        max_align = max_align.max(a);
        off = off.div_ceil(a) * a;
        out.push((n.clone(), off));
        off += s * len;
    }
    (out, off.div_ceil(max_align) * max_align)
}

macro_rules! check_struct {
    ($c:literal, $rust:ty, [$($f:ident),*]) => {{
        let (offs, size) = layout(&fields($c));
        let rust: Vec<(String, usize)> = vec![$((stringify!($f).to_string(), std::mem::offset_of!($rust, $f))),*];
        assert_eq!(offs, rust, "field names/offsets of {} vs {}", $c, stringify!($rust));
        assert_eq!(size, std::mem::size_of::<$rust>(), "size of {}", $c);
    }};
}

#[test]
fn rust_descriptors_match_the_cuda_header() {
    use kvtier::CopyPair;
    check_struct!("kvt_pair", CopyPair, [gpu_page, slot, reserved]);
    assert_eq!(std::mem::size_of::<CopyPair>(), 16);
    #[cfg(feature = "cuda")]
    {
        use kvtier::internals::cuda::desc::*;
        check_struct!("kvt_pair", KvtPair, [gpu_page, slot, reserved]);
        check_struct!("kvt_arena", KvtArena, [base, page_stride, bytes_per_page, slot_offset]);
        check_struct!("kvt_seg", KvtSeg, [arena, offset, len, reserved]);
        check_struct!(
            "kvt_copy_args",
            KvtCopyArgs,
            [arenas, segs, pairs, host_base, slot_bytes, item_begin, item_end, segs_per_block, flags, inline_pairs]
        );
        check_struct!(
            "kvt_pattern_args",
            KvtPatternArgs,
            [arenas, segs, pages, seeds, mismatch, n, delay_ns, segs_per_block, n_arenas]
        );
        let d = defines();
        assert_eq!(d["KVT_SEG_BYTES"], SEG_BYTES);
        assert_eq!(d["KVT_THREADS"], COPY_THREADS as u64);
        assert_eq!(d["KVT_INLINE_PAIRS"], INLINE_PAIRS as u64);
        assert_eq!(d["KVT_FLAG_SLOT_IS_INDEX"], FLAG_SLOT_IS_INDEX as u64);
    }
}

#[test]
fn geometry_alignment_matches_the_kernels() {
    // The kernels move 16 B per access and assume 16-byte aligned units, strides and bases.
    assert_eq!(kvtier::COPY_ALIGN, 16);
    assert_eq!(kvtier::SLOT_CHUNK_ALIGN % 16, 0);
}

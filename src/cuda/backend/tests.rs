use super::staged::{pieces, ItemMap};
use super::*;

#[test]
fn ramp_doubles_up_to_the_cap_and_covers_the_total() {
    assert_eq!(ramp(0, 10, 100), Vec::<u64>::new());
    assert_eq!(ramp(5, 10, 100), vec![5]);
    assert_eq!(ramp(100, 10, 40), vec![10, 20, 40, 30]);
    assert_eq!(ramp(200, 10, 40), vec![10, 20, 40, 40, 40, 40, 10]);
    assert_eq!(ramp(7, 100, 3), vec![3, 3, 1]);
}

fn glm52_map() -> (Geometry, Vec<u64>) {
    let g = Geometry::preset("glm52", 8).unwrap();
    let segs = desc::segment_table(&g).unwrap();
    let mut cum = Vec::new();
    let mut c = 0u64;
    for s in &segs {
        cum.push(c);
        c += s.len as u64;
    }
    (g, cum)
}

#[test]
fn pieces_tile_the_batch_at_segment_boundaries() {
    let (g, cum) = glm52_map();
    let map = ItemMap { seg_cum: &cum, block: g.block_bytes() };
    let (block, spb) = (g.block_bytes(), cum.len() as u64);
    for dir in [Direction::Save, Direction::Restore] {
        for n in [1u64, 2, 8, 43] {
            let p = pieces(n, &map, 0, 256 << 10, 8 * block, dir);
            assert_eq!(p[0].0, 0);
            assert_eq!(p.last().unwrap().1, n * spb);
            assert!(p.windows(2).all(|w| w[0].1 == w[1].0 && w[0].0 < w[0].1));
            // Each piece spans at most 8 + 2 pairs.
            assert!(p.iter().all(|&(a, b)| (b - 1) / spb - a / spb < 10));
        }
        // One block: 256 KiB, 512 KiB, 1 MiB, the rest (ascending for saves).
        let p = pieces(1, &map, 0, 256 << 10, 8 * block, dir);
        assert_eq!(p.len(), 4);
        let (small, big) = if dir == Direction::Save { (p[0], p[3]) } else { (p[3], p[0]) };
        assert!(small.1 - small.0 < big.1 - big.0);
    }
    // The first save piece ends at the first segment boundary at or after 256 KiB.
    let p = pieces(1, &map, 0, 256 << 10, 8 * block, Direction::Save);
    let want = cum.partition_point(|&c| c < 256 << 10) as u64;
    assert_eq!(p[0], (0, want));
}

#[test]
fn pieces_after_a_head_start_at_the_head_and_tile_the_rest() {
    let (g, cum) = glm52_map();
    let map = ItemMap { seg_cum: &cum, block: g.block_bytes() };
    let spb = cum.len() as u64;
    // A 512 KiB head ends at the first segment boundary at or after 512 KiB: 128 segments of
    // 4,096 B (the first 11 arenas' chunks are 10 x 4,096 + 1,024 B each, so fewer).
    let head = map.item_at(512 << 10);
    assert_eq!(map.byte_at(head), cum[head as usize]);
    assert!(map.byte_at(head) >= 512 << 10 && map.byte_at(head - 1) < 512 << 10);
    for dir in [Direction::Save, Direction::Restore] {
        for n in [1u64, 8] {
            let p = pieces(n, &map, head, 1 << 20, 8 * g.block_bytes(), dir);
            assert_eq!(p[0].0, head);
            assert_eq!(p.last().unwrap().1, n * spb);
            assert!(p.windows(2).all(|w| w[0].1 == w[1].0 && w[0].0 < w[0].1));
        }
    }
    // A head past the batch leaves nothing to stage; one in the second block starts there.
    assert!(pieces(1, &map, spb, 1 << 20, 8 * g.block_bytes(), Direction::Save).is_empty());
    let p = pieces(2, &map, spb + 5, 1 << 20, 8 * g.block_bytes(), Direction::Restore);
    assert_eq!((p[0].0, p.last().unwrap().1), (spb + 5, 2 * spb));
    assert_eq!(map.item_at(g.block_bytes()), spb);
    assert_eq!(map.byte_at(spb + 5), g.block_bytes() + cum[5]);
}

#[test]
fn a_driver_error_keeps_its_result_and_formats_without_a_driver() {
    let e = crate::cuda::driver_error(
        "cuLaunchKernel",
        cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
    );
    let text = e.to_string();
    assert!(text.starts_with("CUDA driver call cuLaunchKernel failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)"), "{text}");
    match &e {
        CopyError::Cuda { source, .. } => assert_eq!(source.0 as i32, 700),
        other => panic!("{other:?}"),
    }
    assert!(std::error::Error::source(&e).is_some());
}

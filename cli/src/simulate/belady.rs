//! The offline optimum: Belady's rule under the prefix semantics ([`belady`]), over dense page ids
//! ([`belady_ids`], which the foresight references use too).

use ahash::AHashMap as HashMap;
use kvtier::ContentKey;
use std::collections::BinaryHeap;

/// Dense ids of `keys`' pages for the offline bounds: per request the id of each page, per request
/// and page the index of the next request using that page (`u32::MAX` if none), and the number of
/// distinct pages.
pub fn belady_ids(keys: &[Vec<ContentKey>]) -> (Vec<Vec<u32>>, Vec<Vec<u32>>, usize) {
    let mut ids: HashMap<ContentKey, u32> = HashMap::new();
    let seqs: Vec<Vec<u32>> = keys
        .iter()
        .map(|k| {
            k.iter()
                .map(|key| {
                    let n = ids.len() as u32;
                    *ids.entry(*key).or_insert(n)
                })
                .collect()
        })
        .collect();
    let never = u32::MAX;
    let mut next_seen = vec![never; ids.len()];
    let mut next: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
    for (i, s) in seqs.iter().enumerate().rev() {
        next[i] = s.iter().map(|&p| next_seen[p as usize]).collect();
        for &p in s {
            next_seen[p as usize] = i as u32;
        }
    }
    (seqs, next, ids.len())
}

/// The offline optimum (furthest next use) with the simulation's prefix semantics, on `slots`
/// slots. Returns the hit pages.
pub fn belady(keys: &[Vec<ContentKey>], slots: u32) -> u64 {
    let (seqs, next, ids) = belady_ids(keys);
    // Resident pages: their current (next use, depth); a max-heap with lazy deletion.
    let mut resident: Vec<Option<(u32, u32)>> = vec![None; ids];
    let mut heap: BinaryHeap<(u32, u32, u32)> = BinaryHeap::new();
    let mut count = 0u32;
    let mut hits = 0u64;
    for (i, s) in seqs.iter().enumerate() {
        let h = s.iter().take_while(|&&p| resident[p as usize].is_some()).count();
        hits += h as u64;
        for (d, &p) in s.iter().enumerate() {
            let e = (next[i][d], d as u32);
            if resident[p as usize].is_some() {
                resident[p as usize] = Some(e);
                heap.push((e.0, e.1, p));
                continue;
            }
            if count < slots {
                count += 1;
            } else {
                // Evict the furthest-next-use page if it is used later than this one, else bypass.
                loop {
                    let &(nu, dep, q) = heap.peek().expect("a full pool has resident pages");
                    if resident[q as usize] != Some((nu, dep)) {
                        heap.pop();
                        continue;
                    }
                    break;
                }
                let &(nu, dep, q) = heap.peek().expect("checked above");
                if (nu, dep) <= e {
                    continue;
                }
                heap.pop();
                resident[q as usize] = None;
            }
            resident[p as usize] = Some(e);
            heap.push((e.0, e.1, p));
        }
    }
    hits
}

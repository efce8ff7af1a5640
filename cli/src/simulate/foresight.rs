//! The foresight reference: a policy that knows the page uses of the next `R` requests exactly,
//! and nothing beyond them, and is LRU for the rest. At `R = 0` it is plain LRU (deepest page
//! first among the pages of one request); at `R` as long as the trace it is the offline optimum's
//! rule ([`super::belady`]). It tells how much exact knowledge of the future a hit ratio amounts
//! to; it is not a bound: another policy could use the same knowledge better, and under the prefix
//! semantics more foresight can even lose hits on a small trace (keeping a page that a later page
//! of the same request needs can push out a shallower page the next request's prefix needs).
//!
//! With the simulation's prefix semantics (a request hits the longest resident prefix of its pages,
//! then every missing page is offered for admission in order), at request `i` a resident page's next
//! use `n` is *seen* when `R >= 1` and `n <= i + R` (the next `R` requests, and the rest of request
//! `i` itself). The victim is a page whose next use is not seen, least recently used first (deepest
//! first on ties); only when every resident page's next use is seen, the one used furthest ahead
//! (deepest first on ties), and then only if the page offered is used sooner (a page whose next use
//! is not seen is then not admitted).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A resident page's state: its next use (a request index, `u32::MAX` for never), its last use and
/// its depth in its request.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct State {
    next: u32,
    last: u32,
    depth: u32,
}

/// Hit pages of the foresight reference with horizon `horizon` requests (see the module) on `slots`
/// slots, over `seqs` (one dense page id per page, per request, ids below `ids`) whose per-page next
/// uses are `next` (`next[i][d]`: the next request after `i` using page `seqs[i][d]`, `u32::MAX` if
/// none).
pub fn foresight_hits(seqs: &[Vec<u32>], next: &[Vec<u32>], ids: usize, slots: u32, horizon: u32) -> u64 {
    let mut resident: Vec<Option<State>> = vec![None; ids];
    // Pages whose next use was not seen when they were last touched, least recently used first
    // (deepest first on ties); an entry whose page has since been seen moves to `seen`.
    let mut unseen: BinaryHeap<Reverse<(u32, Reverse<u32>, u32)>> = BinaryHeap::new();
    // Pages whose next use is seen, furthest first (deepest first on ties).
    let mut seen: BinaryHeap<(u32, u32, u32)> = BinaryHeap::new();
    let mut count = 0u32;
    let mut hits = 0u64;
    // (Seeded bug, tests only: `foresight-blind` sees nothing whatever the horizon.)
    let blind = crate::seeded::seeded("foresight-blind");
    for (i, s) in seqs.iter().enumerate() {
        let i = i as u32;
        // With a horizon, the current request's own later pages are seen too (their recorded next
        // use is this request); without one nothing is.
        let sees = |n: u32| horizon > 0 && !blind && n != u32::MAX && u64::from(n) <= u64::from(i) + u64::from(horizon);
        let h = s.iter().take_while(|&&p| resident[p as usize].is_some()).count();
        hits += h as u64;
        for (d, &p) in s.iter().enumerate() {
            let st = State { next: next[i as usize][d], last: i, depth: d as u32 };
            if resident[p as usize].is_none() {
                if count < slots {
                    count += 1;
                } else if !evict(&mut resident, &mut unseen, &mut seen, &sees, st) {
                    continue;
                }
            }
            resident[p as usize] = Some(st);
            if sees(st.next) {
                seen.push((st.next, st.depth, p));
            } else {
                unseen.push(Reverse((st.last, Reverse(st.depth), p)));
            }
        }
    }
    hits
}

/// Frees one slot for a page offered with state `offered`, by the module's rule: true if a page
/// was evicted, false if the offered page is not admitted.
fn evict(
    resident: &mut [Option<State>],
    unseen: &mut BinaryHeap<Reverse<(u32, Reverse<u32>, u32)>>,
    seen: &mut BinaryHeap<(u32, u32, u32)>,
    sees: &dyn Fn(u32) -> bool,
    offered: State,
) -> bool {
    // The least recently used page whose next use is still not seen. Entries of pages touched or
    // evicted since are stale; pages whose next use has come into view move to `seen`.
    while let Some(Reverse((last, Reverse(depth), q))) = unseen.pop() {
        let Some(st) = resident[q as usize] else { continue };
        if st.last != last || st.depth != depth {
            continue;
        }
        if sees(st.next) {
            seen.push((st.next, st.depth, q));
            continue;
        }
        resident[q as usize] = None;
        return true;
    }
    // Every resident page's next use is seen: the furthest goes if the offered page is used sooner.
    while let Some(&(nu, depth, q)) = seen.peek() {
        if resident[q as usize].is_none_or(|st| st.next != nu || st.depth != depth) {
            seen.pop();
            continue;
        }
        if !sees(offered.next) || (nu, depth) <= (offered.next, offered.depth) {
            return false;
        }
        seen.pop();
        resident[q as usize] = None;
        return true;
    }
    unreachable!("a full pool has resident pages, each in one of the two heaps")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::{belady, belady_ids};
    use kvtier::ContentKey;

    /// A small trace of shared prefixes, returning conversations and one-off requests (page ids).
    fn trace() -> Vec<Vec<u32>> {
        let mut t = Vec::new();
        let mut x = 1_u64;
        let mut fresh = 1000;
        for i in 0..400u32 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let conv = ((x >> 33) % 12) as u32;
            let len = 2 + ((x >> 40) % 6) as u32;
            let mut r: Vec<u32> = vec![0];
            r.extend((0..len).map(|d| conv * 10 + d + 1));
            if i % 3 == 0 {
                r.extend((0..3).map(|_| {
                    fresh += 1;
                    fresh
                }));
            }
            t.push(r);
        }
        t
    }

    fn keys(t: &[Vec<u32>]) -> Vec<Vec<ContentKey>> {
        t.iter().map(|r| r.iter().map(|&p| ContentKey::from_words(u64::from(p) + 1, 0)).collect()).collect()
    }

    /// Plain LRU with the same prefix semantics (deepest page first on ties of last use).
    fn lru_hits(t: &[Vec<u32>], slots: usize) -> u64 {
        let mut last: std::collections::HashMap<u32, (u32, u32)> = Default::default();
        let mut hits = 0;
        for (i, r) in t.iter().enumerate() {
            hits += r.iter().take_while(|p| last.contains_key(p)).count() as u64;
            for (d, &p) in r.iter().enumerate() {
                if !last.contains_key(&p) && last.len() == slots {
                    let (&v, _) = last.iter().min_by_key(|(_, &(l, dep))| (l, Reverse(dep))).expect("full");
                    last.remove(&v);
                }
                last.insert(p, (i as u32, d as u32));
            }
        }
        hits
    }

    #[test]
    fn no_foresight_is_lru_and_foresight_of_the_whole_trace_is_the_optimum() {
        let t = trace();
        let (seqs, next, ids) = belady_ids(&keys(&t));
        for slots in [4u32, 9, 20, 40] {
            let lru = lru_hits(&t, slots as usize);
            assert_eq!(foresight_hits(&seqs, &next, ids, slots, 0), lru, "R = 0 at {slots} slots");
            let opt = belady(&keys(&t), slots);
            assert_eq!(foresight_hits(&seqs, &next, ids, slots, t.len() as u32), opt, "R = all at {slots} slots");
            assert!(lru < opt, "the trace separates LRU from the optimum at {slots} slots");
        }
    }
}

//! [`QuadHeap`]: the min-heap of the victim order's entries ([`super::order`]).
//!
//! A 4-ary heap in one vector: the children of entry `i` are `4i + 1 ..= 4i + 4`. Against a binary
//! heap it halves the levels a pop walks down (10 instead of 20 at a million entries), and the four
//! children it compares at each level are 64 contiguous bytes for the order's 16-byte entries (one
//! or two cache lines, where a binary heap's deep levels cost one cache miss each). A pop moves the
//! last entry down from the root, comparing at each level the smallest child with it; a push moves
//! the new entry up from the end. The victim order pushes mostly entries newer than everything in
//! the heap (a new block's tick), which stop at once, and pops from the top, which walk the depth.

/// A min-heap of `T` (4-ary, in one vector). `pop` returns the smallest entry.
#[derive(Clone, Debug)]
pub(crate) struct QuadHeap<T> {
    v: Vec<T>,
}

impl<T: Ord + Copy> Default for QuadHeap<T> {
    fn default() -> Self {
        QuadHeap { v: Vec::new() }
    }
}

impl<T: Ord + Copy> QuadHeap<T> {
    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.v.len()
    }

    /// The smallest entry, if any.
    #[inline]
    pub(crate) fn peek(&self) -> Option<&T> {
        self.v.first()
    }

    /// Adds `x`: O(log4 n), O(1) for an entry no smaller than its parent.
    pub(crate) fn push(&mut self, x: T) {
        self.v.push(x);
        let mut i = self.v.len() - 1;
        while i > 0 {
            let p = (i - 1) / 4;
            if self.v[p] <= x {
                break;
            }
            self.v[i] = self.v[p];
            i = p;
        }
        self.v[i] = x;
    }

    /// Removes and returns the smallest entry: O(log4 n).
    pub(crate) fn pop(&mut self) -> Option<T> {
        let last = self.v.pop()?;
        if self.v.is_empty() {
            return Some(last);
        }
        let top = self.v[0];
        self.sift_down(0, last);
        Some(top)
    }

    /// Puts `x` at `i` or below it, moving smaller children up.
    fn sift_down(&mut self, mut i: usize, x: T) {
        let n = self.v.len();
        loop {
            let first = 4 * i + 1;
            if first >= n {
                break;
            }
            let end = (first + 4).min(n);
            // The next level is the children of whichever child wins here: start loading all
            // four candidates' children now, so the miss on the deep levels of a large heap
            // overlaps this level's comparisons instead of following them.
            for g in (first..end).map(|c| 4 * c + 1).take_while(|&g| g < n) {
                crate::sync::prefetch_read(&self.v[g]);
            }
            let mut m = first;
            for c in first + 1..end {
                if self.v[c] < self.v[m] {
                    m = c;
                }
            }
            if self.v[m] >= x {
                break;
            }
            self.v[i] = self.v[m];
            i = m;
        }
        self.v[i] = x;
    }

    /// Keeps only the entries for which `keep` is true, then restores the heap order: O(n).
    pub(crate) fn retain(&mut self, keep: impl FnMut(&T) -> bool) {
        self.v.retain(keep);
        if self.v.len() > 1 {
            for i in (0..=(self.v.len() - 2) / 4).rev() {
                let x = self.v[i];
                self.sift_down(i, x);
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::QuadHeap;
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

    /// Random pushes, pops and retains on a 4-ary heap and on std's binary heap give the same
    /// smallest entries in the same order.
    #[test]
    fn pops_what_a_binary_heap_pops() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let (mut quad, mut bin) = (QuadHeap::default(), BinaryHeap::new());
        for step in 0..20_000 {
            match rnd(10) {
                0..=5 => {
                    let v = (rnd(1000), step);
                    quad.push(v);
                    bin.push(Reverse(v));
                }
                6..=8 => assert_eq!(quad.pop(), bin.pop().map(|Reverse(v)| v), "step {step}"),
                _ => {
                    let cut = rnd(1000);
                    quad.retain(|&(k, _)| k % 7 != cut % 7);
                    bin.retain(|Reverse((k, _))| k % 7 != cut % 7);
                }
            }
            assert_eq!(quad.len(), bin.len());
            assert_eq!(quad.peek(), bin.peek().map(|Reverse(v)| v));
        }
        while let Some(Reverse(v)) = bin.pop() {
            assert_eq!(quad.pop(), Some(v));
        }
        assert_eq!(quad.pop(), None);
    }
}

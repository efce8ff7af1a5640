//! Workload shapes for `kvtier synth --shape`: traces of kinds the conversation trace does not
//! contain, written from stated parameters (not fitted to any trace), so a policy tuned on the
//! conversation trace can be held against workloads it never saw.
//!
//! Lengths are in trace blocks of 512 tokens (eight 64-token GLM-5.2 pages); times in ms. Every
//! shape is a set of **sessions**: a session starts with a prompt, and each next turn resends the
//! previous prompt, less its last (partial) block, plus new blocks, after a return time. What
//! differs is how sessions start, how long their prompts are and what they share:
//!
//! | shape | sessions | shared prefix | prompt | turns |
//! |---|---|---|---|---|
//! | `agentic` | coding agents, one new every 20 s (Poisson) | one of 4 agent prompts of 20 blocks | starts at 78-156 blocks (40-80 k tokens), +2-16 blocks per turn, at most 390 blocks (200 k tokens) | next turn with probability 0.92, after 2-20 s |
//! | `short` | independent chat requests, 20 per s | one of 8 system prompts of 2-4 blocks (Zipf) | 1-6 blocks past it | 10% get one follow-up after 5-60 s |
//! | `shared-prompt` | assistants behind one 10 k-token system prompt, 4 new per s | one prompt of 20 blocks (10,240 tokens) | 1-16 blocks past it | next turn with probability 0.5, after 10-120 s |
//! | `bursty` | document jobs: a burst of 50-300 requests over one document within 5 s, every 60-180 s, over a background of 1 conversation per s | the burst's document, 16-128 blocks (30% of bursts reuse an earlier document, Zipf) | 1-4 question blocks past it | background conversations: probability 0.5, after 10-120 s |
//!
//! With seed 1, 2,000 `agentic` requests have prompts of 39,692-198,909 tokens, 64.8% of them
//! longer than a pool of 1,244 slots of 64-token pages holds (79,616 tokens): requests larger
//! than a small pool are the common case there.
//!
//! Uniform ranges are inclusive. Completion lengths are uniform in 64-1,024 tokens (2,048 for
//! `agentic`); the last block of each prompt holds 1-512 tokens.

use crate::synth::Rng;
use crate::trace::{TraceRequest, TRACE_BLOCK_TOKENS};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A workload shape (see the module docs).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Long multi-turn coding-agent sessions whose prompts grow to 200 k tokens.
    Agentic,
    /// Many independent short requests with small shared system prompts.
    Short,
    /// Every session behind one shared 10 k-token system prompt.
    SharedPrompt,
    /// Bursts of requests over one long document, over background conversations.
    Bursty,
}

impl Shape {
    /// Every shape, in the order of the module docs' table.
    pub const ALL: [Shape; 4] = [Shape::Agentic, Shape::Short, Shape::SharedPrompt, Shape::Bursty];

    /// The shape's name (what `--shape` takes).
    pub fn name(self) -> &'static str {
        match self {
            Shape::Agentic => "agentic",
            Shape::Short => "short",
            Shape::SharedPrompt => "shared-prompt",
            Shape::Bursty => "bursty",
        }
    }
}

impl std::str::FromStr for Shape {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Shape::ALL.into_iter().find(|x| x.name() == s).ok_or_else(|| {
            let known: Vec<_> = Shape::ALL.iter().map(|x| x.name()).collect();
            format!("unknown shape `{s}` (known: {})", known.join(", "))
        })
    }
}

/// Draws for one shape.
struct Gen {
    rng: Rng,
    next_id: u64,
}

impl Gen {
    /// `n` block ids never used before.
    fn fresh(&mut self, n: u64) -> Vec<u64> {
        let v = (self.next_id..self.next_id + n).collect();
        self.next_id += n;
        v
    }
    /// Uniform in `lo..=hi`.
    fn uniform(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.rng.next() % (hi - lo + 1)
    }
    /// Exponential with mean `mean`.
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.rng.unit()).ln()
    }
    /// An index in `0..n` with Zipf popularity (the `i`-th in proportion to `1 / (i + 1)`).
    fn zipf(&mut self, n: usize) -> usize {
        let total: f64 = (1..=n).map(|i| 1.0 / i as f64).sum();
        let mut x = self.rng.unit() * total;
        for i in 0..n {
            x -= 1.0 / (i + 1) as f64;
            if x < 0.0 {
                return i;
            }
        }
        n - 1
    }
    fn chance(&mut self, p: f64) -> bool {
        self.rng.unit() < p
    }
}

/// A live session: its last prompt's blocks and how its next turn grows it.
struct Session {
    ids: Vec<u64>,
}

/// How a shape's sessions continue.
struct Turns {
    /// Probability of a next turn after each turn.
    p_next: f64,
    /// Return time range, ms.
    gap_ms: (u64, u64),
    /// Blocks a turn adds.
    growth: (u64, u64),
    /// A prompt is never longer than this (the session ends instead).
    max_blocks: usize,
    /// At most this many follow-ups (`usize::MAX`: no bound).
    max_turns: usize,
}

/// Generates `requests` requests of `shape` from `seed` (same seed, same trace), in time order
/// from time 0.
pub fn generate(shape: Shape, seed: u64, requests: usize) -> Vec<TraceRequest> {
    let mut g = Gen { rng: Rng(seed ^ 0x7368_6170_6573_0001 ^ (shape as u64) << 56), next_id: 0 };
    let max_out = if shape == Shape::Agentic { 2048 } else { 1024 };
    // Shared prefixes made up front.
    let agent_prompts: Vec<Vec<u64>> = (0..4).map(|_| g.fresh(20)).collect();
    let chat_prompts: Vec<Vec<u64>> =
        (0..8).map(|_| g.uniform(2, 4)).collect::<Vec<_>>().into_iter().map(|n| g.fresh(n)).collect();
    let system_prompt = g.fresh(20);
    let mut documents: Vec<Vec<u64>> = Vec::new();
    let turns = match shape {
        Shape::Agentic => {
            Turns { p_next: 0.92, gap_ms: (2_000, 20_000), growth: (2, 16), max_blocks: 390, max_turns: usize::MAX }
        }
        Shape::Short => {
            Turns { p_next: 0.10, gap_ms: (5_000, 60_000), growth: (1, 3), max_blocks: usize::MAX, max_turns: 1 }
        }
        Shape::SharedPrompt | Shape::Bursty => Turns {
            p_next: 0.5,
            gap_ms: (10_000, 120_000),
            growth: (1, 8),
            max_blocks: usize::MAX,
            max_turns: usize::MAX,
        },
    };
    // New sessions per ms.
    let mean_new_ms = match shape {
        Shape::Agentic => 20_000.0,
        Shape::Short => 50.0,
        Shape::SharedPrompt => 250.0,
        Shape::Bursty => 1_000.0,
    };
    let mut sessions: Vec<(Session, usize)> = Vec::new();
    let mut pending: BinaryHeap<(Reverse<u64>, usize)> = BinaryHeap::new();
    // Burst requests to come: (time, document).
    let mut burst: BinaryHeap<(Reverse<u64>, usize)> = BinaryHeap::new();
    let mut next_burst = if shape == Shape::Bursty { g.uniform(60_000, 180_000) as f64 } else { f64::INFINITY };
    let mut next_new = 0f64;
    let mut out = Vec::with_capacity(requests);
    while out.len() < requests {
        let due_turn = pending.peek().map(|&(Reverse(t), _)| t as f64).unwrap_or(f64::INFINITY);
        let due_burst = burst.peek().map(|&(Reverse(t), _)| t as f64).unwrap_or(f64::INFINITY);
        let t_min = due_turn.min(due_burst).min(next_new).min(next_burst);
        let (t, ids, session) = if t_min == next_burst {
            // A burst starts: its requests spread over 5 s.
            let doc = if !documents.is_empty() && g.chance(0.3) {
                g.zipf(documents.len())
            } else {
                let len = g.uniform(16, 128);
                documents.push(g.fresh(len));
                documents.len() - 1
            };
            for _ in 0..g.uniform(50, 300) {
                burst.push((Reverse(next_burst as u64 + g.uniform(0, 5_000)), doc));
            }
            next_burst += g.uniform(60_000, 180_000) as f64;
            continue;
        } else if t_min == due_burst {
            let (Reverse(t), doc) = burst.pop().expect("peeked");
            let mut ids = documents[doc].clone();
            let q = g.uniform(1, 4);
            ids.extend(g.fresh(q));
            (t, ids, None)
        } else if t_min == due_turn {
            let (Reverse(t), c) = pending.pop().expect("peeked");
            let grow = g.uniform(turns.growth.0, turns.growth.1);
            let (s, done) = &mut sessions[c];
            s.ids.pop();
            s.ids.extend((g.next_id..g.next_id + grow + 1).collect::<Vec<u64>>());
            g.next_id += grow + 1;
            *done += 1;
            let ids = s.ids.clone();
            if ids.len() > turns.max_blocks {
                continue; // the session would outgrow its context: it ended
            }
            (t, ids, Some(c))
        } else {
            let t = next_new as u64;
            next_new += g.exp(mean_new_ms);
            let ids = match shape {
                Shape::Agentic => {
                    let mut ids = agent_prompts[g.uniform(0, 3) as usize].clone();
                    let n = g.uniform(78, 156) - 20;
                    ids.extend(g.fresh(n));
                    ids
                }
                Shape::Short => {
                    let mut ids = chat_prompts[g.zipf(chat_prompts.len())].clone();
                    let n = g.uniform(1, 6);
                    ids.extend(g.fresh(n));
                    ids
                }
                Shape::SharedPrompt | Shape::Bursty => {
                    let mut ids = if shape == Shape::SharedPrompt {
                        system_prompt.clone()
                    } else {
                        chat_prompts[g.zipf(chat_prompts.len())].clone()
                    };
                    let n = g.uniform(1, 16);
                    ids.extend(g.fresh(n));
                    ids
                }
            };
            sessions.push((Session { ids: ids.clone() }, 0));
            (t, ids, Some(sessions.len() - 1))
        };
        // Sessions (not burst requests) may continue.
        if let Some(c) = session {
            if sessions[c].1 < turns.max_turns && g.chance(turns.p_next) {
                let gap = g.uniform(turns.gap_ms.0, turns.gap_ms.1);
                pending.push((Reverse(t + gap), c));
            }
        }
        let tail = g.uniform(1, TRACE_BLOCK_TOKENS as u64);
        out.push(TraceRequest {
            timestamp_ms: t,
            input_length: (ids.len() as u64 - 1) * TRACE_BLOCK_TOKENS as u64 + tail,
            output_length: g.uniform(64, max_out),
            hash_ids: ids,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_is_deterministic_time_ordered_and_well_formed() {
        for shape in Shape::ALL {
            let a = generate(shape, 7, 3_000);
            assert_eq!(a, generate(shape, 7, 3_000), "{shape:?}: same seed, same trace");
            assert_ne!(a, generate(shape, 8, 3_000), "{shape:?}: another seed, another trace");
            assert_eq!(a.len(), 3_000);
            assert!(a.windows(2).all(|w| w[0].timestamp_ms <= w[1].timestamp_ms), "{shape:?}: time order");
            for r in &a {
                assert!(!r.hash_ids.is_empty());
                let blocks = r.hash_ids.len() as u64;
                assert!(r.input_length > (blocks - 1) * 512 && r.input_length <= blocks * 512, "{shape:?}");
            }
        }
    }

    #[test]
    fn the_shapes_have_their_stated_lengths_and_sharing() {
        let agentic = generate(Shape::Agentic, 1, 2_000);
        let longest = agentic.iter().map(|r| r.hash_ids.len()).max().unwrap();
        let shortest = agentic.iter().map(|r| r.hash_ids.len()).min().unwrap();
        assert!(shortest >= 78 && longest <= 390, "agentic prompts of {shortest}..{longest} blocks");
        // About 65% of the requests are larger than 1,244 slots of 64-token pages (79,616 tokens).
        let larger = agentic.iter().filter(|r| r.input_length > 1_244 * 64).count();
        assert_eq!(larger, 1_296, "{larger} of 2,000 agentic requests longer than 79,616 tokens");
        // A turn continues its session: most agentic requests extend an earlier prompt.
        let first: std::collections::HashSet<u64> = agentic.iter().map(|r| r.hash_ids[25]).collect();
        assert!(first.len() < agentic.len() / 4, "{} sessions in 2,000 agentic requests", first.len());

        let shared = generate(Shape::SharedPrompt, 1, 2_000);
        let head = &shared[0].hash_ids[..20];
        assert!(shared.iter().all(|r| &r.hash_ids[..20] == head), "every request starts with the 20-block prompt");

        let short = generate(Shape::Short, 1, 2_000);
        assert!(short.iter().all(|r| r.hash_ids.len() <= 4 + 6 + 4), "short prompts");

        let bursty = generate(Shape::Bursty, 1, 5_000);
        let docs = bursty.iter().filter(|r| r.hash_ids.len() >= 17).count();
        assert!(docs > 1_000, "{docs} of 5,000 bursty requests read a document");
    }

    #[test]
    fn shape_names_parse() {
        for s in Shape::ALL {
            assert_eq!(s.name().parse::<Shape>(), Ok(s));
        }
        assert_eq!(
            "long".parse::<Shape>().unwrap_err(),
            "unknown shape `long` (known: agentic, short, shared-prompt, bursty)"
        );
    }
}

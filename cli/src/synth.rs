//! `kvtier synth`: synthetic conversation traces whose parameters are drawn from a real trace's own
//! statistics, a second family of workloads for `kvtier simulate` (a policy tuned on one trace is
//! checked on workloads it never saw).
//!
//! [`fit`] reads a Mooncake-format trace and measures, with no knowledge of how it was made:
//!
//! - **shared system prefixes**: the prefix nodes (runs of leading `hash_ids`) that at least
//!   [`SHARED_FANOUT`] different next blocks follow, i.e. prefixes that unrelated prompts start
//!   with, and how often each starts a new conversation;
//! - **conversations**: a request whose longest prefix shared with an earlier request reaches past
//!   every shared system prefix on its path continues the most recent such request (its *parent*);
//!   otherwise it starts a conversation. Measured: the rate of new conversations, the probability
//!   that turn `k` gets a next turn (over turns at least the 90th percentile return time before the
//!   end, which had time for one), the time from a turn to the next (**return time**), the blocks a
//!   turn adds to its parent's prompt, and the first turn's length past its system prefix;
//! - **lengths**: prompt tokens in the last (partial) block, and completion lengths.
//!
//! [`generate`] replays that model with its own random numbers (a seed): conversations start as a
//! Poisson process, each picks a system prefix by the measured popularity, and each turn is followed
//! by the next with the measured probability after a sampled return time (times
//! [`SynthOptions::gap_scale`]). A continuation's blocks are its parent's, less the parent's last
//! (partial) block, plus fresh ones. Every distribution is resampled from the measured values, so
//! the generator has no shape of its own to tune.

use crate::trace::{TraceRequest, TRACE_BLOCK_TOKENS};
use std::collections::{BinaryHeap, HashMap};

/// A prefix node followed by at least this many different next blocks is a shared system prefix.
pub const SHARED_FANOUT: usize = 16;

/// Turns after which the probability of a next turn is pooled (too few conversations are longer).
pub const MAX_TURN_CLASS: usize = 8;

/// What [`fit`] measured (see the module docs). Empirical lists are resampled as they are.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SynthParams {
    /// Time span of the trace in ms.
    pub duration_ms: u64,
    /// New conversations per second.
    pub new_per_s: f64,
    /// Shared system prefixes: their length in blocks and how many conversations started with each.
    pub system_prefixes: Vec<(usize, u64)>,
    /// Probability that turn `k + 1` has a next turn (the last entry for every later turn).
    pub p_next: Vec<f64>,
    /// Times from a turn to its next turn, ms.
    pub return_ms: Vec<u64>,
    /// Blocks a turn adds to its parent's prompt (parent's blocks less the last, plus this plus 1).
    pub growth_blocks: Vec<usize>,
    /// Blocks of a first turn past its system prefix (at least 1).
    pub first_blocks: Vec<usize>,
    /// Prompt tokens in the last block (1..=512).
    pub tail_tokens: Vec<u64>,
    /// Completion lengths in tokens.
    pub output_lengths: Vec<u64>,
    /// Requests measured, conversations found.
    pub requests: usize,
    /// Conversations (first turns) found.
    pub conversations: usize,
}

/// Measures `reqs` (see the module docs). An empty trace gives empty parameters.
pub fn fit(reqs: &[TraceRequest]) -> SynthParams {
    let mut p = SynthParams { requests: reqs.len(), ..SynthParams::default() };
    if reqs.is_empty() {
        return p;
    }
    // Prefix trie over hash ids: node -> (children's next ids, last request through it).
    let mut node_of: HashMap<(u32, u64), u32> = HashMap::new();
    let mut nexts: Vec<std::collections::HashSet<u64>> = vec![Default::default()];
    let mut last_req: Vec<usize> = vec![usize::MAX];
    let path = |ids: &[u64], node_of: &mut HashMap<(u32, u64), u32>, nexts: &mut Vec<_>, last: &mut Vec<usize>| {
        let mut n = 0u32;
        let mut nodes = Vec::with_capacity(ids.len());
        for &id in ids {
            let next_len = nexts.len() as u32;
            let child = *node_of.entry((n, id)).or_insert(next_len);
            if child == next_len {
                nexts.push(Default::default());
                last.push(usize::MAX);
            }
            let set: &mut std::collections::HashSet<u64> = &mut nexts[n as usize];
            if set.len() < SHARED_FANOUT {
                set.insert(id);
            }
            n = child;
            nodes.push(n);
        }
        nodes
    };
    // Pass 1: build the trie, so fan-outs are the whole trace's.
    let all: Vec<Vec<u32>> = reqs.iter().map(|r| path(&r.hash_ids, &mut node_of, &mut nexts, &mut last_req)).collect();
    let shared = |n: u32| nexts[n as usize].len() >= SHARED_FANOUT;
    // Pass 2: in trace order, each request's parent (or its system prefix).
    let mut turn = vec![1usize; reqs.len()];
    let mut has_next = vec![false; reqs.len()];
    let mut sys_count: HashMap<usize, u64> = HashMap::new();
    let mut turns_at: Vec<u64> = vec![0; MAX_TURN_CLASS];
    let mut nexts_at: Vec<u64> = vec![0; MAX_TURN_CLASS];
    for (i, (r, nodes)) in reqs.iter().zip(&all).enumerate() {
        // Deepest shared system prefix on this request's path (root: 0 blocks).
        let sys = nodes.iter().rposition(|&n| shared(n)).map_or(0, |d| d + 1);
        // Longest prefix seen before, and the latest request through it.
        let seen = nodes.iter().take_while(|&&n| last_req[n as usize] != usize::MAX).count();
        let parent = (seen > sys).then(|| last_req[nodes[seen - 1] as usize]);
        match parent {
            Some(j) if !has_next[j] => {
                has_next[j] = true;
                turn[i] = turn[j] + 1;
                p.return_ms.push(r.timestamp_ms.saturating_sub(reqs[j].timestamp_ms));
                let plen = reqs[j].hash_ids.len();
                p.growth_blocks.push((r.hash_ids.len() + 1).saturating_sub(plen).saturating_sub(1));
            }
            Some(_) => {
                // A second continuation of the same request (a branch): a turn, but no new return.
                turn[i] = 2;
            }
            None => {
                p.conversations += 1;
                *sys_count.entry(sys).or_insert(0) += 1;
                p.first_blocks.push((r.hash_ids.len() - sys).max(1));
            }
        }
        for &n in nodes {
            last_req[n as usize] = i;
        }
        let tail = r.input_length.saturating_sub((r.hash_ids.len() as u64 - 1) * TRACE_BLOCK_TOKENS as u64);
        p.tail_tokens.push(tail.clamp(1, TRACE_BLOCK_TOKENS as u64));
        p.output_lengths.push(r.output_length);
    }
    // A turn near the end of the trace has no time left for its next one: count the probability of
    // a next turn only over turns at least the 90th percentile return time before the end.
    let t_end = reqs.iter().map(|r| r.timestamp_ms).max().unwrap_or(0);
    let horizon = {
        let mut g = p.return_ms.clone();
        g.sort_unstable();
        g.get(g.len() * 9 / 10).copied().unwrap_or(0)
    };
    for i in 0..reqs.len() {
        if reqs[i].timestamp_ms.saturating_add(horizon) > t_end && t_end > horizon {
            continue;
        }
        let k = (turn[i] - 1).min(MAX_TURN_CLASS - 1);
        turns_at[k] += 1;
        nexts_at[k] += has_next[i] as u64;
    }
    // Pool sparse turn classes into the one before them.
    let mut last = 0.0;
    for k in 0..MAX_TURN_CLASS {
        let v = if turns_at[k] >= 20 { nexts_at[k] as f64 / turns_at[k] as f64 } else { last };
        p.p_next.push(v);
        last = v;
    }
    let t0 = reqs.iter().map(|r| r.timestamp_ms).min().unwrap_or(0);
    let t1 = reqs.iter().map(|r| r.timestamp_ms).max().unwrap_or(0);
    p.duration_ms = (t1 - t0).max(1);
    p.new_per_s = p.conversations as f64 / (p.duration_ms as f64 / 1000.0);
    let mut sys: Vec<(usize, u64)> = sys_count.into_iter().collect();
    sys.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    p.system_prefixes = sys;
    if p.return_ms.is_empty() {
        p.return_ms.push(p.duration_ms);
        p.growth_blocks.push(1);
    }
    p
}

/// Options of [`generate`].
#[derive(Clone, Debug, PartialEq)]
pub struct SynthOptions {
    /// Seed of the random numbers (same seed, same trace).
    pub seed: u64,
    /// Requests to generate.
    pub requests: usize,
    /// Multiplies every sampled return time (1.0: as measured).
    pub gap_scale: f64,
    /// Distinct system prefixes: `None` keeps the measured ones; `Some(n)` draws `n` prefixes with
    /// lengths resampled from the measured ones, chosen with Zipf popularity (the `i`-th most
    /// popular in proportion to `1 / i`).
    pub system_prompts: Option<usize>,
}

impl Default for SynthOptions {
    /// Seed 1, 12,000 requests, measured return times and system prefixes.
    fn default() -> Self {
        SynthOptions { seed: 1, requests: 12_000, gap_scale: 1.0, system_prompts: None }
    }
}

/// splitmix64: a small, well-mixed generator (no dependency for a handful of draws).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub(crate) fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[(self.next() % v.len() as u64) as usize]
    }
}

struct Conversation {
    ids: Vec<u64>,
    turn: usize,
}

/// Generates a trace from `params` (see the module docs): `opts.requests` requests in time order,
/// timestamps from 0.
///
/// Returns an empty trace for parameters measured on an empty trace.
pub fn generate(params: &SynthParams, opts: &SynthOptions) -> Vec<TraceRequest> {
    if params.first_blocks.is_empty() || params.new_per_s <= 0.0 {
        return Vec::new();
    }
    let mut rng = Rng(opts.seed ^ 0x6b76_7469_6572_5359);
    let mut next_id = 0u64;
    let mut fresh = |n: usize| -> Vec<u64> {
        let v = (next_id..next_id + n as u64).collect();
        next_id += n as u64;
        v
    };
    // System prefixes (their block ids) and their popularity.
    let (prefixes, weights): (Vec<Vec<u64>>, Vec<f64>) = match opts.system_prompts {
        None => params.system_prefixes.iter().map(|&(len, n)| (fresh(len), n as f64)).unzip(),
        Some(n) => {
            let lens: Vec<usize> = params.system_prefixes.iter().map(|&(l, _)| l).collect();
            (0..n.max(1))
                .map(|i| (fresh(if lens.is_empty() { 0 } else { rng.pick(&lens) }), 1.0 / (i + 1) as f64))
                .unzip()
        }
    };
    let total: f64 = weights.iter().sum();
    let mean_gap_ms = 1000.0 / params.new_per_s;
    let mut convs: Vec<Conversation> = Vec::new();
    // Pending turns: (Reverse(time), conversation).
    let mut pending: BinaryHeap<(std::cmp::Reverse<u64>, usize)> = BinaryHeap::new();
    let mut next_new = 0f64;
    let mut out = Vec::with_capacity(opts.requests);
    while out.len() < opts.requests {
        let due = pending.peek().map(|&(std::cmp::Reverse(t), _)| t);
        let (t, c) = if due.is_some_and(|t| (t as f64) <= next_new) {
            let (std::cmp::Reverse(t), c) = pending.pop().expect("peeked");
            let conv = &mut convs[c];
            let growth = rng.pick(&params.growth_blocks);
            conv.ids.pop();
            let add = fresh(growth + 1);
            conv.ids.extend(add);
            conv.turn += 1;
            (t, c)
        } else {
            let t = next_new as u64;
            next_new += -mean_gap_ms * (1.0 - rng.unit()).ln();
            let mut x = rng.unit() * total;
            let mut which = 0;
            for (i, w) in weights.iter().enumerate() {
                which = i;
                if x < *w {
                    break;
                }
                x -= w;
            }
            let mut ids = prefixes.get(which).cloned().unwrap_or_default();
            let first = rng.pick(&params.first_blocks);
            ids.extend(fresh(first));
            convs.push(Conversation { ids, turn: 1 });
            (t, convs.len() - 1)
        };
        let conv = &convs[c];
        let tail = rng.pick(&params.tail_tokens);
        out.push(TraceRequest {
            timestamp_ms: t,
            input_length: (conv.ids.len() as u64 - 1) * TRACE_BLOCK_TOKENS as u64 + tail,
            output_length: rng.pick(&params.output_lengths),
            hash_ids: conv.ids.clone(),
        });
        let p = params.p_next[(conv.turn - 1).min(params.p_next.len() - 1)];
        if rng.unit() < p {
            let gap = (rng.pick(&params.return_ms) as f64 * opts.gap_scale).round() as u64;
            pending.push((std::cmp::Reverse(t + gap.max(1)), c));
        }
    }
    out
}

/// Writes `reqs` as JSON Lines (the Mooncake format) to `w`.
///
/// # Errors
/// The writer's I/O errors.
pub fn write_jsonl(reqs: &[TraceRequest], mut w: impl std::io::Write) -> std::io::Result<()> {
    for r in reqs {
        serde_json::to_writer(&mut w, r)?;
        w.write_all(b"\n")?;
    }
    Ok(())
}

impl SynthParams {
    /// A short human-readable summary (for `kvtier synth --describe`).
    pub fn describe(&self) -> String {
        let med = |v: &[u64]| {
            let mut v = v.to_vec();
            v.sort_unstable();
            v.get(v.len() / 2).copied().unwrap_or(0)
        };
        let medu = |v: &[usize]| med(&v.iter().map(|&x| x as u64).collect::<Vec<_>>());
        format!(
            "{} requests over {:.0} s: {} conversations ({:.2} new per s), {} returns (median return time {} ms, \
             median growth {} blocks); next-turn probability by turn {:?}; {} shared system prefixes (blocks, \
             conversations): {:?}; median first turn {} blocks past its system prefix",
            self.requests,
            self.duration_ms as f64 / 1000.0,
            self.conversations,
            self.new_per_s,
            self.return_ms.len(),
            med(&self.return_ms),
            medu(&self.growth_blocks),
            self.p_next.iter().map(|p| (p * 1000.0).round() / 1000.0).collect::<Vec<_>>(),
            self.system_prefixes.len(),
            &self.system_prefixes[..self.system_prefixes.len().min(8)],
            medu(&self.first_blocks),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(t: u64, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp_ms: t,
            input_length: (ids.len() as u64 - 1) * 512 + 100,
            output_length: 7,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn fit_finds_system_prefixes_conversations_and_returns() {
        // Shared prefix [0] (16 different next blocks); conversation a (1, 2) returns after 1,000 ms
        // and 3,000 ms; b, c and 29 more (one block each past [0]) never return.
        let mut reqs = vec![
            req(0, &[0, 1, 2]),
            req(10, &[0, 3]),
            req(20, &[0, 4, 5]),
            req(1000, &[0, 1, 6, 7]),
            req(4000, &[0, 1, 6, 8, 9, 10]),
        ];
        reqs.extend((0..29).map(|i| req(10_000 + 10 * i, &[0, 100 + i])));
        reqs.push(req(20_000, &[0, 200]));
        let p = fit(&reqs);
        assert_eq!(p.conversations, 33);
        assert_eq!(p.system_prefixes, vec![(1, 33)]);
        assert_eq!(p.return_ms, vec![1000, 3000]);
        // [0,1,2] -> [0,1,6,7]: 4 + 1 - 3 - 1 = 1 block added; [0,1,6,7] -> 6 blocks: 2 added.
        assert_eq!(p.growth_blocks, vec![1, 2]);
        assert_eq!(&p.first_blocks[..3], &[2, 1, 2]);
        assert_eq!(p.tail_tokens, vec![100; 35]);
        assert_eq!(p.duration_ms, 20_000);
        // The last request is within the 90th percentile return time (3,000 ms) of the end: not
        // counted. Turn 1: 32 requests, one has a next turn; turns 2 and 3 (one each, fewer than 20)
        // take turn 1's probability.
        assert_eq!(&p.p_next[..3], &[1.0 / 32.0, 1.0 / 32.0, 1.0 / 32.0]);
    }

    #[test]
    fn generate_is_deterministic_and_keeps_conversations_as_prefixes() {
        let reqs: Vec<TraceRequest> = (0..200u64)
            .map(|i| {
                if i % 2 == 0 {
                    req(i * 100, &[0, 1000 + i, 2000 + i])
                } else {
                    req(i * 100, &[0, 1000 + i - 1, 3000 + i, 4000 + i])
                }
            })
            .collect();
        let p = fit(&reqs);
        assert_eq!(p.conversations, 100);
        assert_eq!(&p.p_next[..2], &[1.0, 0.0]);
        let opts = SynthOptions { seed: 7, requests: 300, ..SynthOptions::default() };
        let a = generate(&p, &opts);
        assert_eq!(a, generate(&p, &opts), "same seed, same trace");
        assert_eq!(a.len(), 300);
        assert!(a.windows(2).all(|w| w[0].timestamp_ms <= w[1].timestamp_ms), "time order");
        assert!(a.iter().all(|r| r.hash_ids[0] == 0), "every prompt starts with the system prefix");
        // Every continuation extends an earlier prompt less its last block.
        let mut seen = std::collections::HashSet::new();
        let mut conts = 0;
        for r in &a {
            if r.hash_ids.len() >= 3 && seen.contains(&r.hash_ids[..r.hash_ids.len() - 2]) {
                conts += 1;
            }
            for k in 1..=r.hash_ids.len() {
                seen.insert(r.hash_ids[..k].to_vec());
            }
        }
        assert!(conts > 0);
        let b = generate(&p, &SynthOptions { seed: 8, ..opts.clone() });
        assert_ne!(a, b);
    }
}

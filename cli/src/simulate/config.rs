//! What a simulation runs: the tier variants ([`Variant`]: policy, chain-aware victims, hints)
//! and the whole configuration ([`SimConfig`]: geometry, pool sizes, policies, SSD sizes, bounds).

use kvtier::PolicyKind;
use std::fmt::Write as _;

/// One tier configuration that [`run_policy`](super::run_policy) drives: a policy, chain-aware victims on or off, and
/// scheduler hints for a modelled engine queue.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Variant {
    /// The eviction policy.
    pub policy: PolicyKind,
    /// Chain-aware victims ([`TierConfig::chain_aware`](kvtier::TierConfig::chain_aware)): orphans, then chain leaves, then the rest.
    pub chain: bool,
    /// Hints for the next `lookahead` requests (0: no hints): before request `i` is queried, the
    /// engine queue holds requests `i + 1 ..= i + lookahead` (trace order), each hinted with
    /// [`HostTier::hint`](kvtier::HostTier::hint) while it waits and withdrawn when it is admitted.
    pub lookahead: usize,
    /// Queue-protecting admission ([`TierConfig::protect_hinted`](kvtier::TierConfig::protect_hinted)): a save never evicts a block
    /// a queued request will look up (only with a lookahead).
    pub protect: bool,
}

impl Variant {
    /// `policy` alone: no chain ranking, no hints (the classic policy).
    pub fn plain(policy: PolicyKind) -> Self {
        Variant { policy, chain: false, lookahead: 0, protect: false }
    }

    /// `policy` with chain-aware victims `chain` and hints for `lookahead` requests, without
    /// queue-protecting admission.
    pub fn new(policy: PolicyKind, chain: bool, lookahead: usize) -> Self {
        Variant { policy, chain, lookahead, protect: false }
    }

    /// The row label: the policy's name, `+chain` if chain-aware, `+la{N}` with a lookahead of N,
    /// `+protect` with queue-protecting admission.
    pub fn label(&self) -> String {
        let mut s = self.policy.name().to_string();
        if self.chain {
            s.push_str("+chain");
        }
        if self.lookahead > 0 {
            let _ = write!(s, "+la{}", self.lookahead);
        }
        if self.protect {
            s.push_str("+protect");
        }
        s
    }
}

/// What to simulate (`kvtier simulate`'s options, parsed).
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Geometry preset whose slot size turns byte sizes into slots and whose namespace keys pages.
    pub geometry: String,
    /// Pool sizes as given: bytes with a unit (`8GiB`, `500MB`) or slots (`9952slots`); see
    /// [`parse_slots`](crate::size::parse_slots).
    pub pools: Vec<String>,
    /// Policies to run, in this order.
    pub policies: Vec<PolicyKind>,
    /// Chain-aware settings to run each policy with (`[false]`, `[true]` or both).
    pub chain: Vec<bool>,
    /// Also run each policy with hints for an engine queue of this many requests (0: not).
    pub lookahead: usize,
    /// With a lookahead, also run each policy with it and queue-protecting admission
    /// ([`Variant::protect`]).
    pub protect: bool,
    /// Also compute the offline optimum ([`belady`](super::belady)) at each size.
    pub optimum: bool,
    /// Horizons in requests of the foresight reference ([`foresight::foresight_hits`](super::foresight::foresight_hits)) to compute at
    /// each size (rows `foresight-R`); empty: none.
    pub foresight: Vec<u32>,
    /// SSD tier sizes as given (bytes with a unit or `Nslots`; see [`parse_disk_slots`](crate::size::parse_disk_slots)): each
    /// variant also runs over each host pool size with each of these under it
    /// ([`two_level::run_two_level`](super::two_level::run_two_level)). Empty: host pool only.
    pub ssd: Vec<String>,
    /// SSD admissions to run each two-level case with (`auto` by default).
    pub ssd_admit: Vec<kvtier::SsdAdmit>,
}

impl Default for SimConfig {
    /// GLM-5.2, pools of 8, 16, 32 and 64 GiB, every built-in policy with and without chain-aware
    /// victims, no hints, with the optimum.
    fn default() -> Self {
        SimConfig {
            geometry: "glm52".into(),
            pools: ["8GiB", "16GiB", "32GiB", "64GiB"].map(String::from).to_vec(),
            policies: PolicyKind::ALL.to_vec(),
            chain: vec![false, true],
            lookahead: 0,
            protect: false,
            optimum: true,
            foresight: Vec::new(),
            ssd: Vec::new(),
            ssd_admit: vec![kvtier::SsdAdmit::Auto],
        }
    }
}

impl SimConfig {
    /// The variants run, in report order: each policy, with each chain setting, without hints,
    /// (with a lookahead) with them, and (with [`SimConfig::protect`] too) with them and
    /// queue-protecting admission.
    pub fn variants(&self) -> Vec<Variant> {
        let mut v = Vec::new();
        let mut looks = vec![(0, false)];
        if self.lookahead > 0 {
            looks.push((self.lookahead, false));
            if self.protect {
                looks.push((self.lookahead, true));
            }
        }
        for &policy in &self.policies {
            for &chain in &self.chain {
                for &(lookahead, protect) in &looks {
                    v.push(Variant { policy, chain, lookahead, protect });
                }
            }
        }
        v
    }

    /// Requests the policy runs of [`run`](super::run) replay in all (`variants x pools x (1 + ssd sizes x
    /// admissions) x requests`): the
    /// length of a progress bar fed by `run`'s `progress`.
    pub fn steps(&self, requests: usize) -> u64 {
        (self.variants().len() * self.pools.len() * (1 + self.ssd.len() * self.ssd_admit.len())) as u64
            * requests as u64
    }
}

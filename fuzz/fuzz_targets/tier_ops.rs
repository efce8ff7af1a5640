//! The tier state machine of `tests/machine/mod.rs` driven by ops decoded from raw bytes: every step
//! is checked against the reference model (no slot owned twice, ready bytes match their keys, pins
//! and stats as modelled).
#![no_main]

#[path = "../../tests/machine/mod.rs"]
mod machine;

use libfuzzer_sys::fuzz_target;
use kvtier::PolicyKind;
use machine::{Machine, Op, MAX_CAPACITY};

fuzz_target!(|data: &[u8]| {
    let Some((&cap, mut rest)) = data.split_first() else { return };
    // The first byte picks the policy and the capacity.
    let policy = PolicyKind::ALL[(cap >> 4) as usize % PolicyKind::ALL.len()];
    let mut m = Machine::new(policy, 1 + cap % MAX_CAPACITY);
    let mut steps = 0;
    while let Some(op) = Op::decode(&mut rest) {
        m.step(op);
        steps += 1;
        if steps == 64 {
            break;
        }
    }
    m.finish();
});

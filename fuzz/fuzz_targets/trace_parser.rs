//! `kvtier_cli::trace::parse` on arbitrary bytes: never panics; a malformed line is reported with its
//! 1-based number (within the input), a line that is not UTF-8 included (reading from a slice never
//! fails otherwise, so no I/O error may appear); every
//! accepted request satisfies the format's rules and maps to page keys without panicking.
#![no_main]

use kvtier::Namespace;
use kvtier_cli::trace::{self, TraceRequest};
use kvtier_cli::TraceError;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let lines = data.split(|&b| b == b'\n').count();
    match trace::parse(data) {
        Ok(reqs) => {
            let nonblank = data.split(|&b| b == b'\n').filter(|l| !l.iter().all(u8::is_ascii_whitespace)).count();
            assert!(reqs.len() <= nonblank, "{} requests from {nonblank} non-blank lines", reqs.len());
            let ns = Namespace::from_description(b"fuzz");
            for r in &reqs {
                check(r);
                let keys = r.page_keys(&ns, 64);
                assert_eq!(keys.len(), r.page_count(64));
            }
        }
        Err(TraceError::Malformed { line, message }) => {
            assert!((1..=lines).contains(&line), "line {line} of a {lines}-line input: {message}");
            assert!(!message.is_empty());
        }
        Err(e) => panic!("unexpected error from parse: {e}"),
    }
});

fn check(r: &TraceRequest) {
    assert!(r.input_length > 0, "accepted input_length 0");
    assert!(!r.hash_ids.is_empty(), "accepted empty hash_ids");
    // Re-serialising an accepted request parses back to the same request.
    let line = serde_json_line(r);
    let back = trace::parse_str(&line).expect("a serialised request parses");
    assert_eq!(back.as_slice(), std::slice::from_ref(r));
}

fn serde_json_line(r: &TraceRequest) -> String {
    let ids: Vec<String> = r.hash_ids.iter().map(u64::to_string).collect();
    format!(
        "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": {}, \"hash_ids\": [{}]}}",
        r.timestamp_ms,
        r.input_length,
        r.output_length,
        ids.join(", ")
    )
}

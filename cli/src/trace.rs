//! Mooncake-format request traces: parsing, validation and the mapping from trace blocks to page keys.
//!
//! A trace is JSON Lines, one request per line (format: the Mooncake FAST'25 trace release,
//! kvcache-ai/Mooncake `FAST25-release/traces/`):
//!
//! ```text
//! {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3]}
//! ```
//!
//! - `timestamp`: arrival time in ms from the start of the trace;
//! - `input_length`, `output_length`: prompt and completion length in tokens;
//! - `hash_ids`: the prompt's prefix-block ids, one per [`TRACE_BLOCK_TOKENS`] tokens of prompt (the
//!   last one covers the remainder). Equal ids at equal positions are the same reusable KV.
//!
//! A trace file may be zstd-compressed (recognised by its magic bytes, whatever its name): the full
//! conversation trace ships as `data/mooncake_conversation_trace.jsonl.zst` ([`FULL_TRACE`]).
//!
//! Every field must be a non-negative integer (`hash_ids` a non-empty array of them), `input_length`
//! must be positive; other fields are ignored and blank lines are skipped. A malformed line is a
//! [`TraceError::Malformed`] naming its 1-based line number.
//!
//! # Pages
//! A trace block of 512 tokens is `512 / page_tokens` engine pages (8 pages of 64 tokens for
//! GLM-5.2). A request has `min(floor(input_length / page_tokens), pages_per_block * len(hash_ids))`
//! *full* pages (a partial last page is recomputed, never cached), and page `j`'s content key is
//! `namespace.trace_page_key(hash_ids[j / ppb], j % ppb)` ([`TraceRequest::page_keys`]).

use crate::error::TraceError;
use kvtier::{ContentKey, Namespace};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

/// Tokens per trace block (one `hash_ids` entry).
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// The bundled sample: the first 80 requests of the Mooncake conversation trace, unmodified (see
/// `data/README.md` for attribution). The default input of `kvtier replay`.
pub const SAMPLE: &str = include_str!("../data/mooncake_conversation_sample.jsonl");

/// Where the whole conversation trace (12,031 requests, zstd-compressed) lies, relative to the
/// repository root. [`load`] reads it directly.
pub const FULL_TRACE: &str = "data/mooncake_conversation_trace.jsonl.zst";

/// The first bytes of a zstd frame.
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

/// Magic bytes of compressed formats the reader recognises but does not decode.
const OTHER_MAGIC: [(&[u8], &str); 3] = [(&[0x1f, 0x8b], "gzip"), (b"\xfd7zXZ\0", "xz"), (b"BZh", "bzip2")];

/// Display name used for [`SAMPLE`] in errors and reports.
pub const SAMPLE_NAME: &str = "<embedded sample>";

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time in ms from the start of the trace (`timestamp` in the file).
    #[serde(rename = "timestamp")]
    pub timestamp_ms: u64,
    /// Prompt length in tokens (> 0).
    pub input_length: u64,
    /// Completion length in tokens.
    pub output_length: u64,
    /// Prefix-block ids, one per 512 prompt tokens (non-empty).
    pub hash_ids: Vec<u64>,
}

/// Engine pages per 512-token trace block for `page_tokens`-token pages, or `None` if
/// `page_tokens` is zero or does not divide 512.
pub fn pages_per_block(page_tokens: u32) -> Option<u64> {
    (page_tokens != 0 && TRACE_BLOCK_TOKENS % page_tokens == 0).then(|| (TRACE_BLOCK_TOKENS / page_tokens) as u64)
}

impl TraceRequest {
    /// Full pages of this request for `page_tokens`-token pages:
    /// `min(floor(input_length / page_tokens), pages_per_block * len(hash_ids))`.
    ///
    /// Panics if `page_tokens` does not divide 512 (check with [`pages_per_block`] first).
    pub fn page_count(&self, page_tokens: u32) -> usize {
        let ppb = pages_per_block(page_tokens).expect("page_tokens must divide 512");
        (self.input_length / page_tokens as u64).min(ppb * self.hash_ids.len() as u64) as usize
    }

    /// The content keys of this request's full pages, in prompt order ([`TraceRequest::page_count`]
    /// of them): page `j`'s key is `ns.trace_page_key(hash_ids[j / ppb], j % ppb)` with
    /// `ppb = 512 / page_tokens`.
    ///
    /// Panics if `page_tokens` does not divide 512 (check with [`pages_per_block`] first).
    pub fn page_keys(&self, ns: &Namespace, page_tokens: u32) -> Vec<ContentKey> {
        let ppb = pages_per_block(page_tokens).expect("page_tokens must divide 512");
        (0..self.page_count(page_tokens) as u64)
            .map(|j| ns.trace_page_key(self.hash_ids[(j / ppb) as usize], j % ppb))
            .collect()
    }
}

/// Splits `reqs` in two at the middle of their time span: requests with `timestamp_ms` below
/// `(first + last) / 2` (of the smallest and largest timestamps), then the others, each in trace
/// order. The conversation trace splits into 5,606 and 6,425 requests.
pub fn split_by_time(reqs: &[TraceRequest]) -> (Vec<TraceRequest>, Vec<TraceRequest>) {
    let lo = reqs.iter().map(|r| r.timestamp_ms).min().unwrap_or(0);
    let hi = reqs.iter().map(|r| r.timestamp_ms).max().unwrap_or(0);
    // Twice the midpoint, so an odd span splits exactly: t < (lo + hi) / 2  <=>  2t < lo + hi.
    let mid2 = lo as u128 + hi as u128;
    reqs.iter().cloned().partition(|r| (2 * r.timestamp_ms as u128) < mid2)
}

fn malformed(line: usize, message: impl Into<String>) -> TraceError {
    TraceError::Malformed { line, message: message.into() }
}

/// Describes a JSON value's kind for error messages.
fn kind(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("string {s:?}"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

fn uint(line: usize, field: &str, v: &Value) -> Result<u64, TraceError> {
    if let Some(x) = v.as_u64() {
        return Ok(x);
    }
    let why = match v {
        Value::Number(n) if n.as_i64().is_some_and(|x| x < 0) => "is negative".to_string(),
        Value::Number(n) if n.is_f64() => format!("is not an integer ({n})"),
        Value::Number(n) => format!("is out of range ({n})"),
        other => format!("must be a non-negative integer, found {}", kind(other)),
    };
    Err(malformed(line, format!("field `{field}` {why}")))
}

fn field<'a>(line: usize, obj: &'a Map<String, Value>, name: &str) -> Result<&'a Value, TraceError> {
    obj.get(name).ok_or_else(|| malformed(line, format!("missing field `{name}`")))
}

/// Parses one non-blank line (1-based number `line`).
fn parse_line(line: usize, text: &str) -> Result<TraceRequest, TraceError> {
    let v: Value = serde_json::from_str(text).map_err(|e| malformed(line, format!("not valid JSON: {e}")))?;
    let obj = match &v {
        Value::Object(o) => o,
        other => return Err(malformed(line, format!("expected a JSON object, found {}", kind(other)))),
    };
    let timestamp_ms = uint(line, "timestamp", field(line, obj, "timestamp")?)?;
    let input_length = uint(line, "input_length", field(line, obj, "input_length")?)?;
    let output_length = uint(line, "output_length", field(line, obj, "output_length")?)?;
    let ids = match field(line, obj, "hash_ids")? {
        Value::Array(a) => a,
        other => return Err(malformed(line, format!("field `hash_ids` must be an array, found {}", kind(other)))),
    };
    if ids.is_empty() {
        return Err(malformed(line, "field `hash_ids` is empty: a request has at least one block"));
    }
    let hash_ids =
        ids.iter().enumerate().map(|(i, x)| uint(line, &format!("hash_ids[{i}]"), x)).collect::<Result<Vec<_>, _>>()?;
    if input_length == 0 {
        return Err(malformed(line, "field `input_length` is 0: a request has at least one prompt token"));
    }
    Ok(TraceRequest { timestamp_ms, input_length, output_length, hash_ids })
}

/// Parses a whole trace from `reader`. Blank (whitespace-only) lines are skipped; an empty trace is
/// returned as an empty vector (callers decide whether that is an error).
///
/// # Errors
/// [`TraceError::Malformed`] for the first malformed line (1-based line number and what is wrong:
/// invalid JSON, not an object, a missing field, a negative, fractional, out-of-range or non-numeric
/// value, empty or non-array `hash_ids`, `input_length` 0); [`TraceError::Io`] (path `<reader>`) if
/// reading fails or a line is not UTF-8.
pub fn parse(reader: impl BufRead) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    for (i, text) in reader.lines().enumerate() {
        let text = text.map_err(|source| match source.kind() {
            // A line that is not UTF-8 is a malformed line, not an I/O failure: name it.
            std::io::ErrorKind::InvalidData => TraceError::Malformed { line: i + 1, message: "not valid UTF-8".into() },
            _ => TraceError::Io { path: PathBuf::from("<reader>"), source },
        })?;
        if text.trim().is_empty() {
            continue;
        }
        out.push(parse_line(i + 1, &text)?);
    }
    Ok(out)
}

/// Parses a trace held in a string (e.g. [`SAMPLE`]).
///
/// # Errors
/// As [`parse`].
pub fn parse_str(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    parse(text.as_bytes())
}

/// The bundled sample ([`SAMPLE`]), parsed.
///
/// # Errors
/// None in practice (the sample is checked by the unit tests); as [`parse`].
pub fn sample() -> Result<Vec<TraceRequest>, TraceError> {
    parse_str(SAMPLE)
}

/// Reads and parses the trace file at `path`: JSON Lines, or JSON Lines compressed with zstd
/// (recognised by the zstd magic bytes, whatever the file is called).
///
/// # Errors
/// [`TraceError::Io`] if the file cannot be opened, read or decompressed;
/// [`TraceError::UnsupportedCompression`] for a gzip, xz or bzip2 file; [`TraceError::Malformed`]
/// as [`parse`] (line numbers of the decompressed text); [`TraceError::Empty`] if it holds no
/// request.
pub fn load(path: impl AsRef<Path>) -> Result<Vec<TraceRequest>, TraceError> {
    let path = path.as_ref();
    let io = |source| TraceError::Io { path: path.to_path_buf(), source };
    let mut file = BufReader::new(std::fs::File::open(path).map_err(io)?);
    let head = file.fill_buf().map_err(io)?;
    if let Some((_, format)) = OTHER_MAGIC.iter().find(|(m, _)| head.starts_with(m)) {
        return Err(TraceError::UnsupportedCompression { path: path.to_path_buf(), format });
    }
    let reader: Box<dyn BufRead> = if head.starts_with(&ZSTD_MAGIC) {
        Box::new(BufReader::new(zstd::Decoder::with_buffer(file).map_err(io)?))
    } else {
        Box::new(file)
    };
    let reqs = parse(reader).map_err(|e| match e {
        TraceError::Io { source, .. } => io(source),
        other => other,
    })?;
    if reqs.is_empty() {
        return Err(TraceError::Empty { path: path.to_path_buf() });
    }
    Ok(reqs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        match parse_str(text) {
            Err(TraceError::Malformed { line, message }) => format!("{line}: {message}"),
            other => panic!("expected a malformed-line error, got {other:?}"),
        }
    }

    #[test]
    fn parses_a_line() {
        let t =
            parse_str("\n{\"timestamp\": 5, \"input_length\": 700, \"output_length\": 3, \"hash_ids\": [4, 9]}\n\n")
                .unwrap();
        assert_eq!(
            t,
            vec![TraceRequest { timestamp_ms: 5, input_length: 700, output_length: 3, hash_ids: vec![4, 9] }]
        );
    }

    #[test]
    fn rejects_each_kind_of_bad_line() {
        let ok = r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}"#;
        let cases = [
            ("{not json", "2: not valid JSON"),
            ("[1, 2]", "2: expected a JSON object, found an array"),
            (r#"{"input_length": 6, "output_length": 1, "hash_ids": [1]}"#, "2: missing field `timestamp`"),
            (r#"{"timestamp": 0, "output_length": 1, "hash_ids": [1]}"#, "2: missing field `input_length`"),
            (r#"{"timestamp": 0, "input_length": 6, "hash_ids": [1]}"#, "2: missing field `output_length`"),
            (r#"{"timestamp": 0, "input_length": 6, "output_length": 1}"#, "2: missing field `hash_ids`"),
            (
                r#"{"timestamp": -1, "input_length": 6, "output_length": 1, "hash_ids": [1]}"#,
                "2: field `timestamp` is negative",
            ),
            (
                r#"{"timestamp": 0, "input_length": 6.5, "output_length": 1, "hash_ids": [1]}"#,
                "2: field `input_length` is not an integer (6.5)",
            ),
            (
                r#"{"timestamp": 0, "input_length": "6", "output_length": 1, "hash_ids": [1]}"#,
                "2: field `input_length` must be a non-negative integer, found string \"6\"",
            ),
            (
                r#"{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": []}"#,
                "2: field `hash_ids` is empty",
            ),
            (
                r#"{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": 3}"#,
                "2: field `hash_ids` must be an array, found number 3",
            ),
            (
                r#"{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [1, -2]}"#,
                "2: field `hash_ids[1]` is negative",
            ),
            (
                r#"{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}"#,
                "2: field `input_length` is 0",
            ),
        ];
        for (bad, want) in cases {
            let got = err(&format!("{ok}\n{bad}\n{ok}\n"));
            assert!(got.starts_with(want), "line {bad}: got `{got}`, want `{want}...`");
        }
    }

    #[test]
    fn a_line_that_is_not_utf8_is_named() {
        let bytes: &[u8] = b"{\"timestamp\":0,\"input_length\":64,\"output_length\":1,\"hash_ids\":[1]}\n\xff\xfe\n";
        match parse(bytes) {
            Err(TraceError::Malformed { line: 2, message }) => assert_eq!(message, "not valid UTF-8"),
            other => panic!("expected a malformed line 2, got {other:?}"),
        }
    }

    #[test]
    fn page_keys_follow_blocks() {
        let ns = Namespace::from_description(b"t");
        // 1100 tokens, 3 blocks: floor(1100/64) = 17 pages < 24.
        let r = TraceRequest { timestamp_ms: 0, input_length: 1100, output_length: 0, hash_ids: vec![7, 8, 9] };
        let k = r.page_keys(&ns, 64);
        assert_eq!(k.len(), 17);
        assert_eq!(k[0], ns.trace_page_key(7, 0));
        assert_eq!(k[7], ns.trace_page_key(7, 7));
        assert_eq!(k[8], ns.trace_page_key(8, 0));
        assert_eq!(k[16], ns.trace_page_key(9, 0));
        // Capped by the block count: 10,000 tokens but one block = 8 pages of 64 (32 of 16).
        let r = TraceRequest { timestamp_ms: 0, input_length: 10_000, output_length: 0, hash_ids: vec![1] };
        assert_eq!(r.page_count(64), 8);
        assert_eq!(r.page_count(16), 32);
        assert_eq!(r.page_keys(&ns, 16)[31], ns.trace_page_key(1, 31));
        // Fewer tokens than one page: no full page.
        let r = TraceRequest { timestamp_ms: 0, input_length: 63, output_length: 0, hash_ids: vec![1] };
        assert!(r.page_keys(&ns, 64).is_empty());
        assert_eq!(pages_per_block(64), Some(8));
        assert_eq!(pages_per_block(48), None);
        assert_eq!(pages_per_block(0), None);
    }

    #[test]
    fn sample_parses() {
        let s = sample().unwrap();
        assert_eq!(s.len(), SAMPLE.lines().count());
        assert_eq!(s[0].hash_ids[..3], [0, 1, 2]);
        assert_eq!(s[0].input_length, 6758);
    }

    #[test]
    fn load_reads_zstd_and_names_other_compressions() {
        let dir = tempfile::tempdir().unwrap();
        // Any name: the magic bytes decide.
        let z = dir.path().join("sample.jsonl");
        std::fs::write(&z, zstd::encode_all(SAMPLE.as_bytes(), 3).unwrap()).unwrap();
        assert_eq!(load(&z).unwrap(), sample().unwrap());
        // A malformed line inside a compressed trace is named by its decompressed line number.
        let bad = format!("{SAMPLE}{{\"timestamp\": 1}}\n");
        std::fs::write(&z, zstd::encode_all(bad.as_bytes(), 3).unwrap()).unwrap();
        match load(&z) {
            Err(TraceError::Malformed { line: 81, message }) => assert_eq!(message, "missing field `input_length`"),
            other => panic!("expected a malformed line 81, got {other:?}"),
        }
        // A truncated frame is an I/O error naming the file.
        let full = zstd::encode_all(SAMPLE.as_bytes(), 3).unwrap();
        std::fs::write(&z, &full[..full.len() / 2]).unwrap();
        let e = load(&z).unwrap_err();
        assert!(matches!(e, TraceError::Io { .. }) && e.to_string().contains("sample.jsonl"), "{e}");
        let gz = dir.path().join("t.jsonl.gz");
        std::fs::write(&gz, [0x1f, 0x8b, 8, 0, 0, 0]).unwrap();
        assert_eq!(
            load(&gz).unwrap_err().to_string(),
            format!(
                "trace {} is gzip-compressed; decompress it or recompress it with zstd (`zstd FILE`)",
                gz.display()
            )
        );
    }

    #[test]
    fn load_reports_path_and_emptiness() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("empty.jsonl");
        std::fs::write(&p, "\n  \n").unwrap();
        assert!(matches!(load(&p), Err(TraceError::Empty { .. })));
        let missing = dir.path().join("nope.jsonl");
        let e = load(&missing).unwrap_err();
        assert!(matches!(e, TraceError::Io { .. }) && e.to_string().contains("nope.jsonl"), "{e}");
    }
}

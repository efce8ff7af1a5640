use super::*;
use crate::error::TierError;

#[test]
fn frames_round_trip_and_a_43_key_query_is_small() {
    let keys: Vec<ContentKey> = (0..43u8).map(|i| ContentKey([i; 16])).collect();
    let q = Request::Query { keys: keys.clone(), uses: 4 };
    let mut buf = Vec::new();
    encode(&q, &mut buf).unwrap();
    // 4 B length + 1 B variant + 1 B key count + 43 x 16 B + 1 B uses.
    assert_eq!(buf.len(), 4 + 1 + 1 + 43 * 16 + 1);
    let mut scratch = Vec::new();
    let back: Request = read_frame(&mut &buf[..], &mut scratch).unwrap();
    assert_eq!(back, q);
    let reply = Reply::Leased {
        lease: 7,
        blocks: keys.iter().map(|&key| WireBlock { key, slot: 3, generation: 1 << 39 }).collect(),
        sources: (0..43)
            .map(|i| if i < 40 { crate::source::BlockSource::Host } else { crate::source::BlockSource::Peer })
            .collect(),
    };
    encode(&reply, &mut buf).unwrap();
    let back: Reply = read_frame(&mut &buf[..], &mut scratch).unwrap();
    assert_eq!(back, reply);
}

#[test]
fn oversized_and_truncated_frames_are_errors() {
    let mut scratch = Vec::new();
    let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
    let e = read_frame::<Request>(&mut &huge[..], &mut scratch).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    let e = read_frame::<Request>(&mut &[5u8, 0, 0, 0, 1][..], &mut scratch).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    let e = read_frame::<Request>(&mut &[][..], &mut scratch).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    // A variant number no request has.
    let e = read_frame::<Request>(&mut &[1u8, 0, 0, 0, 200][..], &mut scratch).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
}

#[test]
fn a_length_prefix_alone_allocates_nothing_near_its_length() {
    // The daemon's reader before any hello: a 64 MiB announcement followed by 60 bytes.
    let mut frame = (MAX_FRAME as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&[7u8; 60]);
    let mut r = &frame[..];
    let len = read_len(&mut r).unwrap();
    let mut buf = Vec::new();
    let e = read_payload(&mut r, len, &mut buf).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    assert!(buf.capacity() <= 2 * READ_CHUNK, "{} B reserved for 60 B that arrived", buf.capacity());
    let e = read_frame::<Request>(&mut &frame[..], &mut buf).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    assert!(buf.capacity() <= 2 * READ_CHUNK, "{} B reserved for 60 B that arrived", buf.capacity());
    // Skipping reads the bytes without keeping them.
    let mut r = &[1u8; 10_000][..];
    skip_payload(&mut r, 9_000).unwrap();
    assert_eq!(r.len(), 1_000);
}

#[test]
fn a_huge_sequence_length_on_a_short_payload_is_an_error_not_an_allocation() {
    // Query (variant 2) whose key count says 2^63: postcard reads elements from the payload's
    // bytes only, so this fails at once (an up-front reservation of 2^63 x 16 B would abort).
    let mut payload = vec![2u8];
    payload.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]);
    payload.extend_from_slice(&[0u8; 40]);
    assert!(decode::<Request>(&payload).is_err());
    // The same for a hint and an audit.
    for variant in [16u8, 20] {
        payload[0] = variant;
        assert!(decode::<Request>(&payload).is_err());
    }
}

#[test]
fn errors_survive_the_wire() {
    let e = TierError::CannotFit { needed: 5, available: 2, capacity: 4 };
    let back = TierError::from(WireError::from(&e));
    assert_eq!(back.to_string(), e.to_string());
    assert!(matches!(TierError::from(WireError::LeaseExpired), TierError::LeaseExpired));
}

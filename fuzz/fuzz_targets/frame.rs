//! The TCP frame layer (tidewire_transport::frame): header decoding, the
//! handshake and region payload decoders, and stream reassembly (`next_frame`).
//!
//! Input: one byte choosing how the stream is cut and the payload cap, then a
//! byte stream as it would arrive on a socket (the seeds are captured streams).
//! Invariants:
//! - every decoder returns `Ok` or a typed error on any bytes (no panic);
//! - what decodes re-encodes to the exact bytes it came from, and
//!   `decode(encode(h)) == h` for headers built from the input;
//! - reassembly is independent of how the stream is split: feeding it in
//!   arbitrary pieces yields the same frames, in order, and the same final
//!   error or the same unconsumed tail as feeding it whole; every frame's
//!   length is within the kind's limit and the cap, and the frames re-encode to
//!   the consumed prefix.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidewire_transport::frame::{
    decode_mac, decode_reason, decode_regions, encode_regions, next_frame, Challenge, DataAttach, Header, Hello, Kind,
    HEADER_LEN, MAGIC, MAX_CONTROL_BYTES, MAX_MESSAGE_BYTES, VERSION,
};
use tidewire_transport::FrameError;

const CAPS: [u32; 6] = [0, 1, 64, 4096, MAX_MESSAGE_BYTES, u32::MAX];

/// Frames and the end state of feeding `stream` in the pieces `cut` yields.
#[derive(Debug, PartialEq)]
struct Outcome {
    frames: Vec<(Header, Vec<u8>)>,
    end: Result<Vec<u8>, FrameError>,
}

fn reassemble(stream: &[u8], cap: u32, mut cut: impl FnMut(usize) -> usize) -> Outcome {
    let mut buf = Vec::new();
    let mut frames = Vec::new();
    let mut pos = 0;
    while pos < stream.len() {
        let n = cut(stream.len() - pos).clamp(1, stream.len() - pos);
        buf.extend_from_slice(&stream[pos..pos + n]);
        pos += n;
        loop {
            match next_frame(&buf, cap) {
                Ok(Some((h, total))) => {
                    assert_eq!(total, HEADER_LEN + h.length as usize);
                    assert!(total <= buf.len());
                    assert!(h.length <= cap && h.length <= h.kind.max_payload());
                    assert_eq!(h.version, VERSION);
                    frames.push((h, buf[HEADER_LEN..total].to_vec()));
                    buf.drain(..total);
                }
                Ok(None) => {
                    // More bytes are needed: the buffer holds less than a frame.
                    if buf.len() >= HEADER_LEN {
                        let h = Header::decode(&buf).expect("next_frame accepted this header");
                        assert!(buf.len() < HEADER_LEN + h.length as usize);
                    }
                    break;
                }
                Err(e) => return Outcome { frames, end: Err(e) },
            }
        }
    }
    Outcome { frames, end: Ok(buf) }
}

fn check_payload_decoders(b: &[u8]) {
    if let Ok(h) = Header::decode_any_version(b) {
        assert_eq!(
            &h.encode()[..],
            &b[..HEADER_LEN],
            "a decoded header re-encodes to its bytes"
        );
        assert_eq!(
            Header::decode(&h.encode()),
            if h.version == VERSION {
                Ok(h)
            } else {
                Err(FrameError::BadVersion(h.version))
            }
        );
    } else if b.len() < HEADER_LEN {
        assert_eq!(
            Header::decode(b),
            Err(FrameError::Truncated {
                need: HEADER_LEN,
                have: b.len()
            })
        );
    }
    if let Ok(h) = Header::decode(b) {
        assert_eq!(h.version, VERSION);
        assert_eq!(u32::from_le_bytes([b[0], b[1], b[2], b[3]]), MAGIC);
        assert!(h.length <= h.kind.max_payload());
    }
    if let Ok(h) = Hello::decode(b) {
        assert_eq!(h.encode(), b);
    }
    if let Ok(c) = Challenge::decode(b) {
        assert_eq!(c.encode(), b);
    }
    if let Ok(d) = DataAttach::decode(b) {
        assert_eq!(d.encode(), b);
    }
    if let Ok(m) = decode_mac(b, "Auth") {
        assert_eq!(&m[..], b);
    }
    if let Ok(l) = decode_regions(b) {
        assert_eq!(encode_regions(&l), b);
    }
    let r = decode_reason(b);
    assert!(r.len() <= 3 * 1024, "a reason is cut at 1024 input bytes");
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().unwrap())
}

/// Headers and payloads built from the input's bytes round-trip.
fn check_round_trips(b: &[u8]) {
    if b.len() < 44 {
        return;
    }
    let kind = Kind::from_u8(1 + b[0] % 12).expect("1..=12 are kinds");
    let h = Header {
        version: VERSION,
        kind,
        flags: u16::from_le_bytes([b[1], b[2]]),
        length: u32_at(b, 3) % (kind.max_payload() + 1),
        imm: u32_at(b, 7),
        region: u32_at(b, 11),
        generation: u32_at(b, 15),
        offset: u64_at(b, 19),
        seq: u64_at(b, 27),
    };
    assert_eq!(Header::decode(&h.encode()), Ok(h));
    let mut too_long = h;
    too_long.length = kind.max_payload().saturating_add(1 + u32_at(b, 35) % 1024);
    if too_long.length > kind.max_payload() {
        assert!(matches!(
            Header::decode(&too_long.encode()),
            Err(FrameError::TooLong { .. })
        ));
    }
    let nonce: [u8; 32] = b[b.len() - 32..].try_into().unwrap();
    let hello = Hello {
        job_id: h.offset,
        rank: h.imm,
        nonce,
    };
    assert_eq!(Hello::decode(&hello.encode()), Ok(hello.clone()));
    let ch = Challenge {
        rank: h.region,
        nonce,
        token: h.seq,
        mac: nonce,
    };
    assert_eq!(Challenge::decode(&ch.encode()), Ok(ch.clone()));
    let da = DataAttach {
        token: h.seq,
        mac: nonce,
    };
    assert_eq!(DataAttach::decode(&da.encode()), Ok(da.clone()));
    // A payload cut short or extended is refused.
    let body = hello.encode();
    let cut = b[39] as usize % body.len();
    assert!(Hello::decode(&body[..cut]).is_err());
    let mut longer = body.clone();
    longer.push(b[40]);
    assert!(Hello::decode(&longer).is_err());
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, stream)) = data.split_first() else {
        return;
    };
    check_payload_decoders(stream);
    check_round_trips(stream);

    let cap = CAPS[(sel >> 5) as usize % CAPS.len()];
    let whole = reassemble(stream, cap, |left| left);
    // Splits: fixed-size pieces (1..=32 bytes), or sizes read from the stream itself.
    let step = (sel & 0x1f) as usize + 1;
    let pieces = reassemble(stream, cap, |_| step);
    assert_eq!(
        whole, pieces,
        "splitting the stream into {step}-byte pieces changed the result"
    );
    let mut i = 0;
    let odd = reassemble(stream, cap, |_| {
        i += 1;
        stream.get(i).map_or(1, |&x| x as usize % 61 + 1)
    });
    assert_eq!(
        whole, odd,
        "splitting the stream at data-chosen points changed the result"
    );

    // The frames re-encode to the prefix of the stream they were cut from.
    let mut re = Vec::new();
    for (h, p) in &whole.frames {
        re.extend_from_slice(&h.encode());
        re.extend_from_slice(p);
    }
    assert_eq!(&stream[..re.len()], &re[..]);
    if let Ok(tail) = &whole.end {
        assert_eq!(&stream[re.len()..], &tail[..]);
    }
    // A header's control payload never exceeds the control cap.
    for (h, p) in &whole.frames {
        if !matches!(h.kind, Kind::Message | Kind::Write) {
            assert!(p.len() <= MAX_CONTROL_BYTES as usize);
        }
        check_payload_decoders(p);
    }
});

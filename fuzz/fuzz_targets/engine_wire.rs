//! The engine's rank protocol (tidewire_engine::wire): tags and payloads of
//! every message one Node sends another.
//!
//! Input: the tag's kind byte (or, with the top bit of the first byte, a raw
//! 32-bit tag), then the payload. Invariants: `decode` never panics and
//! returns a typed `WireError`; what decodes re-encodes to the exact tag and
//! bytes (except `FactorData`, whose bytes are not decoded); every control
//! message that decodes fits `MAX_CONTROL` bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidewire_engine::wire::{decode, encode, kind_of, Kind, Msg, MAX_CONTROL, MAX_CREDITS, MAX_REASON};

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else { return };
    let (tag, payload) = if sel & 0x80 != 0 && rest.len() >= 4 {
        (u32::from_le_bytes(rest[..4].try_into().unwrap()), &rest[4..])
    } else {
        (Kind::Hello.tag() & !0xff | u32::from(sel & 0x7f), rest)
    };
    let kind = kind_of(tag);
    match decode(tag, payload) {
        Ok(msg) => {
            let k = kind.expect("a decoded message has a valid tag");
            assert_eq!(k.tag(), tag);
            if msg == Msg::FactorData {
                assert_eq!(k, Kind::FactorData);
                return;
            }
            match &msg {
                Msg::Credit(s) => assert!(!s.is_empty() && s.len() <= MAX_CREDITS),
                Msg::Abort(r) => assert!(r.len() <= MAX_REASON),
                _ => {}
            }
            let (t2, b2) = encode(&msg);
            assert_eq!(t2, tag);
            assert_eq!(b2, payload, "{msg:?} re-encodes to other bytes");
            if !matches!(msg, Msg::Hello(_)) {
                assert!(b2.len() <= MAX_CONTROL);
            }
            // Cut short or extended by a byte, a fixed layout is refused.
            if !matches!(msg, Msg::Abort(_)) {
                if let Some((_, short)) = payload.split_last() {
                    assert!(decode(tag, short).is_err());
                }
                let mut longer = payload.to_vec();
                longer.push(0);
                assert!(decode(tag, &longer).is_err());
            }
        }
        Err(e) => {
            let _ = e.to_string();
            if let Err(ke) = kind {
                assert_eq!(
                    decode(tag, &[]).unwrap_err(),
                    ke,
                    "a bad tag fails before the payload is read"
                );
            }
        }
    }
});

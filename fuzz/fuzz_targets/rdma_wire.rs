//! The RDMA backend's control-plane and notice decoders
//! (tidewire_transport::rdma::wire, feature `rdma`; no RDMA device needed):
//! queue-pair info, the 32-byte write notice a peer leaves in our ring, abort
//! reasons and receive credits.
//!
//! Input: a selector byte, then the payload. Invariants: no decoder panics; a
//! decoded QP info or notice re-encodes to its exact bytes (notice: all but the
//! 4 reserved bytes); decoded QP info is in range (MTU 1..=5, 24-bit QPN and PSN,
//! non-zero receive depth); encode/decode round-trips for values built from
//! the input; an abort's reason is cut at 1024 bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidewire_transport::rdma::wire::{
    decode_abort, decode_credit, encode_abort, Notice, QpInfo, NOTICE_LEN, QP_INFO_LEN, QP_INFO_VERSION,
};

fuzz_target!(|data: &[u8]| {
    let Some((&sel, b)) = data.split_first() else { return };

    if let Ok(q) = QpInfo::decode(b) {
        assert_eq!(b.len(), QP_INFO_LEN);
        assert_eq!(q.encode(), b);
        assert!((1..=5).contains(&q.mtu) && q.rx_depth > 0 && q.qpn < 1 << 24 && q.psn < 1 << 24);
    }
    if let Ok(n) = Notice::decode(b) {
        assert_eq!(b.len(), NOTICE_LEN);
        let e = n.encode();
        assert_eq!(&e[..28], &b[..28]);
    }
    let (access, reason) = decode_abort(b);
    assert_eq!(access, b.first() == Some(&1));
    if let Ok(c) = decode_credit(b) {
        assert_eq!(b.len(), 4);
        assert_eq!(c.to_le_bytes(), b);
    } else {
        assert_ne!(b.len(), 4);
    }
    // Abort: what a peer encodes, we decode (the reason cut at 1024 bytes, at most).
    let text = String::from_utf8_lossy(b);
    let (a2, r2) = decode_abort(&encode_abort(sel & 1 == 1, &text));
    assert_eq!(a2, sel & 1 == 1);
    assert!(r2.len() <= text.len() + 2 && text.starts_with(r2.trim_end_matches('\u{fffd}')));
    let _ = reason;

    // Round trips of values built from the input.
    if b.len() >= QP_INFO_LEN {
        let mut raw = b[..QP_INFO_LEN].to_vec();
        raw[..4].copy_from_slice(b"TWQP");
        raw[4] = QP_INFO_VERSION;
        raw[31] = 1 + raw[31] % 5; // MTU
        raw[8] = 0; // QPN < 2^24
        raw[12] = 0; // PSN < 2^24
        raw[32] |= 1; // rx_depth > 0
        raw[34] &= 0x0f; // rx_depth <= MAX_RX_DEPTH (2^20)
        raw[35] = 0;
        let q = QpInfo::decode(&raw).expect("a well-formed QP info decodes");
        assert_eq!(QpInfo::decode(&q.encode()), Ok(q));
        for cut in [0, 4, 5, QP_INFO_LEN - 1] {
            assert!(QpInfo::decode(&raw[..cut]).is_err());
        }
    }
    if b.len() >= 24 {
        let n = Notice {
            rkey: u32::from_le_bytes(b[..4].try_into().unwrap()),
            generation: u32::from_le_bytes(b[4..8].try_into().unwrap()),
            offset: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            len: u64::from_le_bytes(b[16..24].try_into().unwrap()),
        };
        assert_eq!(Notice::decode(&n.encode()), Ok(n));
        assert!(Notice::decode(&n.encode()[..NOTICE_LEN - 1]).is_err());
    }
});

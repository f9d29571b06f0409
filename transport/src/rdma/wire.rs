//! What the RDMA backend tells its peer over the authenticated TCP control
//! plane: queue-pair addressing, readiness, region descriptors and the reason
//! for an abort; and the layout of the notification ring its peer writes into
//! (write notices, and the credit word that returns receive credits). Decoding
//! never panics.

use crate::error::{FrameError, Violation};

/// Control-message tags on the inner TCP connection. The inner transport
/// carries nothing else, so these do not collide with user tags (user
/// messages travel as RDMA SENDs).
pub(crate) const TAG_QP_INFO: u32 = 1;
pub(crate) const TAG_READY: u32 = 2;
pub(crate) const TAG_REGIONS: u32 = 3;
pub(crate) const TAG_REVOKE: u32 = 4;
// Tag 5 carried receive credits; they now travel as RDMA WRITEs into the
// peer's credit word (`CREDIT_WORD_LEN`), and 5 is unknown.
pub(crate) const TAG_ABORT: u32 = 6;

const QP_INFO_MAGIC: &[u8; 4] = b"TWQP";
/// Version of the RDMA connection setup. 2: receive credits are RDMA WRITEs into
/// the peer's credit word (version 1 sent them as control messages, tag 5), so
/// the two cannot share a job; a mismatch is refused at setup (`BadVersion`).
pub const QP_INFO_VERSION: u8 = 2;
pub const QP_INFO_LEN: usize = 4 + 1 + 4 + 4 + 2 + 16 + 1 + 4 + 4 + 8 + 4 + 8;

/// One side's queue pair and receive resources, as its peer needs them to
/// bring the RC connection to RTR/RTS and to address the notification ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInfo {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    /// ibv_mtu enum value (1 = 256 B ... 5 = 4096 B).
    pub mtu: u8,
    /// Receives posted for this connection: the peer's initial send credits.
    pub rx_depth: u32,
    /// Largest SEND the receive buffers hold.
    pub max_message: u32,
    /// The notification ring and its rkey: one 32-byte slot per receive, then
    /// the credit word ([`ring_len`], [`credit_word_offset`]).
    pub ring_addr: u64,
    pub ring_rkey: u32,
    /// Largest single RDMA message the device takes (ibv_port_attr.max_msg_sz).
    pub max_msg_sz: u64,
}

impl QpInfo {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(QP_INFO_LEN);
        b.extend_from_slice(QP_INFO_MAGIC);
        b.push(QP_INFO_VERSION);
        b.extend_from_slice(&self.qpn.to_le_bytes());
        b.extend_from_slice(&self.psn.to_le_bytes());
        b.extend_from_slice(&self.lid.to_le_bytes());
        b.extend_from_slice(&self.gid);
        b.push(self.mtu);
        b.extend_from_slice(&self.rx_depth.to_le_bytes());
        b.extend_from_slice(&self.max_message.to_le_bytes());
        b.extend_from_slice(&self.ring_addr.to_le_bytes());
        b.extend_from_slice(&self.ring_rkey.to_le_bytes());
        b.extend_from_slice(&self.max_msg_sz.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        let bad = FrameError::Malformed { what: "QP info" };
        if b.len() != QP_INFO_LEN || &b[..4] != QP_INFO_MAGIC {
            return Err(bad);
        }
        if b[4] != QP_INFO_VERSION {
            return Err(FrameError::BadVersion(b[4]));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[15..31]);
        let info = QpInfo {
            qpn: u32_at(5),
            psn: u32_at(9),
            lid: u16::from_le_bytes([b[13], b[14]]),
            gid,
            mtu: b[31],
            rx_depth: u32_at(32),
            max_message: u32_at(36),
            ring_addr: u64_at(40),
            ring_rkey: u32_at(48),
            max_msg_sz: u64_at(52),
        };
        if !(1..=5).contains(&info.mtu)
            || info.rx_depth == 0
            || info.rx_depth > MAX_RX_DEPTH
            || info.qpn >= 1 << 24
            || info.psn >= 1 << 24
        {
            return Err(bad);
        }
        Ok(info)
    }
}

/// The 32-byte notification a write with an immediate leaves in the target's
/// ring just before its payload: which region, where, and how much. RC
/// ordering places it before the payload's WRITE_WITH_IMM completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Notice {
    pub rkey: u32,
    pub generation: u32,
    pub offset: u64,
    pub len: u64,
}

pub const NOTICE_LEN: usize = 32;

impl Notice {
    pub fn encode(&self) -> [u8; NOTICE_LEN] {
        let mut b = [0u8; NOTICE_LEN];
        b[..4].copy_from_slice(&self.rkey.to_le_bytes());
        b[4..8].copy_from_slice(&self.generation.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..28].copy_from_slice(b"TWNT");
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        if b.len() != NOTICE_LEN || &b[24..28] != b"TWNT" {
            return Err(FrameError::Malformed { what: "write notice" });
        }
        Ok(Notice {
            rkey: u32::from_le_bytes(b[..4].try_into().unwrap()),
            generation: u32::from_le_bytes(b[4..8].try_into().unwrap()),
            offset: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            len: u64::from_le_bytes(b[16..24].try_into().unwrap()),
        })
    }
}

/// Bytes at the end of the notification ring for the credit word: the
/// little-endian `u32` count of receives this side has reposted since the
/// connection began (wrapping), which the peer writes there with an inline RDMA
/// WRITE. Its credits are the receives posted at first plus that count, less
/// the receive-consuming posts it made. A whole notice slot, so the ring stays
/// a multiple of 32 bytes; the word is its first 4 bytes.
pub const CREDIT_WORD_LEN: usize = NOTICE_LEN;

/// The credit word's 8 bytes: the cumulative count of reposted receives and a
/// check of it (a mixing function of every bit, [`credit_check`]), both
/// little-endian u32. A reader accepts the word only when the check matches, so
/// a value caught while the peer's device was still writing it (RDMA does not
/// promise that a write is atomic to the CPU's loads, nor in which order its
/// bytes land) reads as "in flux", not as a grant: a mix of an old and a new
/// word's bytes passes only by a 2^-32-scale coincidence per mix.
pub fn encode_credit_word(total: u32) -> [u8; 8] {
    let mut w = [0u8; 8];
    w[..4].copy_from_slice(&total.to_le_bytes());
    w[4..].copy_from_slice(&credit_check(total).to_le_bytes());
    w
}

/// The count in a credit word read as one little-endian u64, or `None` while its
/// check disagrees (mid-write; look again later). The all-zero word of a fresh
/// ring reads as `None` too: nothing returned yet.
pub fn decode_credit_word(w: u64) -> Option<u32> {
    let (count, check) = (w as u32, (w >> 32) as u32);
    (check == credit_check(count)).then_some(count)
}

/// MurmurHash3's 32-bit finalizer of `x` with a fixed tweak: every output bit
/// depends on every input bit, and 0 does not map to 0.
fn credit_check(x: u32) -> u32 {
    let mut h = x ^ 0x7457_4352; // "TWCR"
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// The length of the notification ring of a side that posted `rx_depth` receives.
pub fn ring_len(rx_depth: u32) -> usize {
    (rx_depth as usize + 1) * NOTICE_LEN
}

/// Where the credit word lies in that ring (4-byte aligned, as the ring is).
pub fn credit_word_offset(rx_depth: u32) -> usize {
    rx_depth as usize * NOTICE_LEN
}

/// The most receives a peer may say it posted (its `rx_depth`): far above what
/// devices allow per queue pair, and the bound on the credits it can grant.
pub(crate) const MAX_RX_DEPTH: u32 = 1 << 20;

/// What a notice's target region is here, as far as the check needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NoticeTarget {
    pub generation: u32,
    pub len: u64,
    pub remote_write: bool,
}

/// Checks a write notice the peer left in the ring as the TCP backend checks
/// a write header (`conn_core.rs`, `RegionTable::check_incoming`): the region is registered
/// here (`target`, looked up by the notice's key) with the notice's
/// generation, it takes remote writes, the range lies inside it without
/// overflow, and the notice's length is what landed (`landed`, from the
/// completion).
pub(crate) fn check_notice(n: &Notice, landed: u64, target: Option<NoticeTarget>) -> Result<(), Violation> {
    let t = target
        .filter(|t| t.generation == n.generation)
        .ok_or(Violation::NoticeUnknownRegion {
            region: n.rkey,
            generation: n.generation,
        })?;
    if !t.remote_write {
        return Err(Violation::NoticeAccess { region: n.rkey });
    }
    match n.offset.checked_add(n.len) {
        Some(end) if end <= t.len => {}
        _ => {
            return Err(Violation::NoticeBounds {
                region: n.rkey,
                offset: n.offset,
                len: n.len,
                region_len: t.len,
            })
        }
    }
    if n.len != landed {
        return Err(Violation::NoticeLength { noticed: n.len, landed });
    }
    Ok(())
}

/// Adds a credit grant to the credits held: the total may not overflow nor
/// exceed `max` (the receives the peer posted), since an honest peer never
/// returns more receives than it has.
pub(crate) fn grant_credits(have: u32, grant: u32, max: u32) -> Result<u32, Violation> {
    match have.checked_add(grant) {
        Some(total) if total <= max => Ok(total),
        _ => Err(Violation::CreditOverflow { have, grant, max }),
    }
}

/// An abort: why this side is tearing the connection down. `access` marks a
/// write the target's device refused (IBV_WC_REM_ACCESS_ERR at the writer).
pub fn encode_abort(access: bool, reason: &str) -> Vec<u8> {
    let mut b = vec![access as u8];
    b.extend_from_slice(&reason.as_bytes()[..reason.len().min(1024)]);
    b
}

pub fn decode_abort(b: &[u8]) -> (bool, String) {
    match b.split_first() {
        Some((&a, rest)) => (a == 1, String::from_utf8_lossy(rest).into_owned()),
        None => (false, "no reason given".into()),
    }
}

/// The credit word's bytes as a count (little-endian `u32`).
pub fn decode_credit(b: &[u8]) -> Result<u32, FrameError> {
    match <[u8; 4]>::try_from(b) {
        Ok(a) => Ok(u32::from_le_bytes(a)),
        Err(_) => Err(FrameError::Malformed { what: "credit" }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> QpInfo {
        QpInfo {
            qpn: 0x11,
            psn: 0xabcdef,
            lid: 0,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 1],
            mtu: 3,
            rx_depth: 64,
            max_message: 65536,
            ring_addr: 0x7f00_0000_1000,
            ring_rkey: 0x1234,
            max_msg_sz: 1 << 31,
        }
    }

    #[test]
    fn qp_info_round_trips_and_rejects_garbage() {
        let i = info();
        let b = i.encode();
        assert_eq!(b.len(), QP_INFO_LEN);
        assert_eq!(QpInfo::decode(&b).unwrap(), i);
        for cut in 0..b.len() {
            assert!(QpInfo::decode(&b[..cut]).is_err());
        }
        let mut v = b.clone();
        v[4] = 9;
        assert_eq!(QpInfo::decode(&v), Err(FrameError::BadVersion(9)));
        let mut m = b.clone();
        m[31] = 0;
        assert!(QpInfo::decode(&m).is_err(), "MTU 0 is not an ibv_mtu");
        let mut q = b;
        q[5..9].copy_from_slice(&(1u32 << 24).to_le_bytes());
        assert!(QpInfo::decode(&q).is_err(), "QPNs are 24 bits");
    }

    #[test]
    fn notices_abort_and_credit() {
        let n = Notice {
            rkey: 7,
            generation: 2,
            offset: 4093,
            len: 14,
        };
        assert_eq!(Notice::decode(&n.encode()).unwrap(), n);
        assert!(
            Notice::decode(&[0u8; NOTICE_LEN]).is_err(),
            "a zeroed slot is not a notice"
        );
        assert_eq!(
            decode_abort(&encode_abort(true, "REM_ACCESS_ERR")),
            (true, "REM_ACCESS_ERR".into())
        );
        assert_eq!(decode_abort(&[]), (false, "no reason given".into()));
        assert_eq!(decode_credit(&5u32.to_le_bytes()), Ok(5));
        assert!(decode_credit(&[1, 2, 3]).is_err());
    }

    #[test]
    fn credit_words_check_themselves() {
        for total in [0, 1, 255, 259, 0x1234_5678, u32::MAX] {
            let w = u64::from_le_bytes(encode_credit_word(total));
            assert_eq!(decode_credit_word(w), Some(total));
        }
        // A fresh ring (all zero) has returned nothing yet.
        assert_eq!(decode_credit_word(0), None);
        // Every mix of an old and a new word's bytes (any order the device may
        // store them in) that is neither reads as in flux, for counts a few apart
        // and counts crossing byte boundaries (255 -> 259: the torn 511 a plain
        // 4-byte word could show is caught). 508000 mixes, seeded.
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let old = (rng as u32) % 100_000;
            let new = old.wrapping_add(1 + (rng >> 40) as u32 % 300);
            let (a, b) = (encode_credit_word(old), encode_credit_word(new));
            for mask in 1u32..255 {
                let mut m = [0u8; 8];
                for i in 0..8 {
                    m[i] = if mask >> i & 1 == 1 { b[i] } else { a[i] };
                }
                if m == a || m == b {
                    continue;
                }
                let got = decode_credit_word(u64::from_le_bytes(m));
                assert!(
                    got.is_none(),
                    "old {old} new {new} mask {mask:08b}: torn word read as {got:?}"
                );
            }
        }
    }

    #[test]
    fn the_credit_word_follows_the_notice_slots() {
        for d in [1u32, 3, 64, MAX_RX_DEPTH] {
            assert_eq!(credit_word_offset(d), d as usize * NOTICE_LEN, "after every slot");
            assert_eq!(ring_len(d), credit_word_offset(d) + CREDIT_WORD_LEN);
            assert_eq!(credit_word_offset(d) % 4, 0, "the word is aligned for a u32 load");
        }
    }

    #[test]
    fn a_peer_cannot_claim_more_receives_than_the_bound() {
        let mut i = info();
        i.rx_depth = MAX_RX_DEPTH + 1;
        assert!(QpInfo::decode(&i.encode()).is_err());
        i.rx_depth = MAX_RX_DEPTH;
        assert!(QpInfo::decode(&i.encode()).is_ok());
    }

    const T: NoticeTarget = NoticeTarget {
        generation: 3,
        len: 4096,
        remote_write: true,
    };

    fn notice(offset: u64, len: u64) -> Notice {
        Notice {
            rkey: 0x55,
            generation: 3,
            offset,
            len,
        }
    }

    #[test]
    fn notices_are_checked_like_tcp_writes() {
        // In range, to the last byte, and an empty write at the end.
        assert_eq!(check_notice(&notice(0, 4096), 4096, Some(T)), Ok(()));
        assert_eq!(check_notice(&notice(4095, 1), 1, Some(T)), Ok(()));
        assert_eq!(check_notice(&notice(4096, 0), 0, Some(T)), Ok(()));
        // No such region here.
        assert_eq!(
            check_notice(&notice(0, 1), 1, None),
            Err(Violation::NoticeUnknownRegion {
                region: 0x55,
                generation: 3
            })
        );
        // A stale (or future) generation.
        for generation in [2, 4, 0, u32::MAX] {
            let n = Notice {
                generation,
                ..notice(0, 1)
            };
            assert!(matches!(
                check_notice(&n, 1, Some(T)),
                Err(Violation::NoticeUnknownRegion { .. })
            ));
        }
        // A region that does not take remote writes.
        let local = NoticeTarget {
            remote_write: false,
            ..T
        };
        assert_eq!(
            check_notice(&notice(0, 1), 1, Some(local)),
            Err(Violation::NoticeAccess { region: 0x55 })
        );
        // Out of bounds: one past the end, past the end entirely, and offset + len overflowing u64.
        for (offset, len) in [(1, 4096), (4096, 1), (u64::MAX, 2), (2, u64::MAX), (u64::MAX, u64::MAX)] {
            assert!(
                matches!(
                    check_notice(&notice(offset, len), len, Some(T)),
                    Err(Violation::NoticeBounds { .. })
                ),
                "{offset}+{len}"
            );
        }
        // A notice that lies about how much landed.
        assert_eq!(
            check_notice(&notice(0, 8), 16, Some(T)),
            Err(Violation::NoticeLength { noticed: 8, landed: 16 })
        );
    }

    #[test]
    fn credit_grants_are_checked() {
        assert_eq!(grant_credits(0, 64, 64), Ok(64));
        assert_eq!(grant_credits(10, 5, 64), Ok(15));
        assert_eq!(grant_credits(64, 0, 64), Ok(64));
        assert_eq!(
            grant_credits(60, 5, 64),
            Err(Violation::CreditOverflow {
                have: 60,
                grant: 5,
                max: 64
            })
        );
        assert!(grant_credits(1, u32::MAX, u32::MAX).is_err(), "overflow");
        assert!(grant_credits(u32::MAX, 1, u32::MAX).is_err(), "overflow at the top");
        assert!(grant_credits(0, 1, 0).is_err(), "no receives posted, no credits");
    }
}

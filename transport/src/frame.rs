//! The wire format: a fixed 40-byte, versioned, length-prefixed header,
//! followed by `length` payload bytes.
//!
//! ```text
//!  0      4   5    6      8        12     16      20           24       32       40
//!  +------+---+----+------+--------+------+-------+------------+--------+--------+
//!  |magic |ver|kind|flags |length  |imm   |region |generation  |offset  |seq     |
//!  |u32 LE|u8 |u8  |u16 LE|u32 LE  |u32 LE|u32 LE |u32 LE      |u64 LE  |u64 LE  |
//!  +------+---+----+------+--------+------+-------+------------+--------+--------+
//! ```
//!
//! Every decoder here takes arbitrary bytes and returns `Result`; none can
//! panic (see the property tests at the bottom and the `frame` fuzz target,
//! `fuzz/fuzz_targets/frame.rs`).

use crate::error::FrameError;

/// `"TDWR"` in little-endian order.
pub const MAGIC: u32 = u32::from_le_bytes(*b"TDWR");
/// The protocol version this build speaks.
pub const VERSION: u8 = 1;
/// Size of every frame header.
pub const HEADER_LEN: usize = 40;
/// Largest payload of a two-sided message (the hard protocol cap).
pub const MAX_MESSAGE_BYTES: u32 = 16 << 20;
/// Largest payload of one one-sided write frame.
pub const MAX_WRITE_BYTES: u32 = 1 << 30;
/// Largest payload of a control frame (handshake, region lists, rejects).
pub const MAX_CONTROL_BYTES: u32 = 1 << 20;
/// Length of nonces and MACs.
pub const NONCE_LEN: usize = 32;

/// The most bytes a connection may make this side hold before it has
/// authenticated (reassembly buffers included). A frame whose header claims
/// more, or a kind the handshake does not expect, is refused as soon as its
/// header arrives, before any payload is read.
pub const PRE_AUTH_MAX_BYTES: usize = 64 * 1024;
/// The most accepted connections that may be handshaking (not yet
/// authenticated) at once, per transport. Past it the oldest is closed.
pub const MAX_PENDING_HANDSHAKES: usize = 64;
/// The largest `Reject` payload accepted (a UTF-8 reason).
pub const MAX_REJECT_BYTES: u32 = 1024;

/// Header flag: the write carries an immediate that the receiver must surface.
pub const FLAG_IMM: u16 = 1;
/// Header flag on a `Regions` frame: the listed regions are revoked.
pub const FLAG_REVOKE: u16 = 2;

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Hello = 1,
    Challenge = 2,
    Auth = 3,
    Ready = 4,
    Reject = 5,
    Message = 6,
    Write = 7,
    Ack = 8,
    Nack = 9,
    Regions = 10,
    Close = 11,
    DataAttach = 12,
}

impl Kind {
    /// Decodes a kind byte.
    pub fn from_u8(b: u8) -> Result<Kind, FrameError> {
        Ok(match b {
            1 => Kind::Hello,
            2 => Kind::Challenge,
            3 => Kind::Auth,
            4 => Kind::Ready,
            5 => Kind::Reject,
            6 => Kind::Message,
            7 => Kind::Write,
            8 => Kind::Ack,
            9 => Kind::Nack,
            10 => Kind::Regions,
            11 => Kind::Close,
            12 => Kind::DataAttach,
            _ => return Err(FrameError::BadKind(b)),
        })
    }

    /// The largest payload this kind may carry.
    pub fn max_payload(self) -> u32 {
        match self {
            Kind::Message => MAX_MESSAGE_BYTES,
            Kind::Write => MAX_WRITE_BYTES,
            _ => MAX_CONTROL_BYTES,
        }
    }

    /// Name for errors and logs.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Hello => "Hello",
            Kind::Challenge => "Challenge",
            Kind::Auth => "Auth",
            Kind::Ready => "Ready",
            Kind::Reject => "Reject",
            Kind::Message => "Message",
            Kind::Write => "Write",
            Kind::Ack => "Ack",
            Kind::Nack => "Nack",
            Kind::Regions => "Regions",
            Kind::Close => "Close",
            Kind::DataAttach => "DataAttach",
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub version: u8,
    pub kind: Kind,
    pub flags: u16,
    pub length: u32,
    pub imm: u32,
    pub region: u32,
    pub generation: u32,
    pub offset: u64,
    pub seq: u64,
}

impl Header {
    /// A header of `kind` with `length` payload bytes and every other field zero.
    pub fn new(kind: Kind, length: u32) -> Self {
        Header {
            version: VERSION,
            kind,
            flags: 0,
            length,
            imm: 0,
            region: 0,
            generation: 0,
            offset: 0,
            seq: 0,
        }
    }

    /// Encodes into the fixed 40-byte layout.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.version;
        b[5] = self.kind as u8;
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.length.to_le_bytes());
        b[12..16].copy_from_slice(&self.imm.to_le_bytes());
        b[16..20].copy_from_slice(&self.region.to_le_bytes());
        b[20..24].copy_from_slice(&self.generation.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    /// Decodes and validates a header: magic, version, kind and the kind's size limit.
    pub fn decode(b: &[u8]) -> Result<Header, FrameError> {
        let h = Self::decode_any_version(b)?;
        if h.version != VERSION {
            return Err(FrameError::BadVersion(h.version));
        }
        Ok(h)
    }

    /// Like [`Header::decode`] but accepts any version, so a handshake can
    /// answer a peer of another version with a precise reject.
    pub fn decode_any_version(b: &[u8]) -> Result<Header, FrameError> {
        let b: &[u8; HEADER_LEN] =
            b.get(..HEADER_LEN)
                .and_then(|s| s.try_into().ok())
                .ok_or(FrameError::Truncated {
                    need: HEADER_LEN,
                    have: b.len(),
                })?;
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let kind = Kind::from_u8(b[5])?;
        let length = u32_at(b, 8);
        if length > kind.max_payload() {
            return Err(FrameError::TooLong {
                len: length,
                max: kind.max_payload(),
            });
        }
        Ok(Header {
            version: b[4],
            kind,
            flags: u16::from_le_bytes([b[6], b[7]]),
            length,
            imm: u32_at(b, 12),
            region: u32_at(b, 16),
            generation: u32_at(b, 20),
            offset: u64_at(b, 24),
            seq: u64_at(b, 32),
        })
    }
}

fn u32_at(b: &[u8; HEADER_LEN], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn u64_at(b: &[u8; HEADER_LEN], i: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(x)
}

/// Finds the next complete frame at the start of `buf`.
///
/// Returns `Ok(None)` when more bytes are needed, or the header and the total
/// frame length (header plus payload) when one is complete. `max_payload`
/// further limits the payload below the kind's own limit.
pub fn next_frame(buf: &[u8], max_payload: u32) -> Result<Option<(Header, usize)>, FrameError> {
    if buf.len() < HEADER_LEN {
        // Reject garbage as early as possible: check the magic once 4 bytes are in.
        if buf.len() >= 4 {
            let magic = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
            if magic != MAGIC {
                return Err(FrameError::BadMagic(magic));
            }
        }
        return Ok(None);
    }
    let h = Header::decode(buf)?;
    if h.length > max_payload {
        return Err(FrameError::TooLong {
            len: h.length,
            max: max_payload,
        });
    }
    let total = HEADER_LEN + h.length as usize;
    if buf.len() < total {
        return Ok(None);
    }
    Ok(Some((h, total)))
}

/// The header at the start of `buf`, as soon as its 40 bytes are in (the
/// payload need not be). Lets a reader check a frame's kind and length against
/// its state before it buffers any payload. `Ok(None)`: fewer than 40 bytes.
pub fn peek_header(buf: &[u8]) -> Result<Option<Header>, FrameError> {
    if buf.len() < HEADER_LEN {
        return next_frame(buf, 0).map(|_| None);
    }
    Header::decode(buf).map(Some)
}

/// A little reader over a payload that never panics.
struct Rd<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.b.len() < n {
            return Err(FrameError::Malformed { what: self.what });
        }
        let (a, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        let s = self.take(8)?;
        let mut x = [0u8; 8];
        x.copy_from_slice(s);
        Ok(u64::from_le_bytes(x))
    }
    fn arr32(&mut self) -> Result<[u8; NONCE_LEN], FrameError> {
        let s = self.take(NONCE_LEN)?;
        let mut x = [0u8; NONCE_LEN];
        x.copy_from_slice(s);
        Ok(x)
    }
    fn end(self) -> Result<(), FrameError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Malformed { what: self.what })
        }
    }
}

/// Client → server, first frame on the control socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub job_id: u64,
    pub rank: u32,
    pub nonce: [u8; NONCE_LEN],
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(44);
        v.extend_from_slice(&self.job_id.to_le_bytes());
        v.extend_from_slice(&self.rank.to_le_bytes());
        v.extend_from_slice(&self.nonce);
        v
    }
    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        let mut r = Rd { b, what: "Hello" };
        let h = Hello {
            job_id: r.u64()?,
            rank: r.u32()?,
            nonce: r.arr32()?,
        };
        r.end()?;
        Ok(h)
    }
}

/// Server → client: the server's nonce and rank, a connection token for the
/// data socket, and the server's proof that it knows the job secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub rank: u32,
    pub nonce: [u8; NONCE_LEN],
    pub token: u64,
    pub mac: [u8; NONCE_LEN],
}

impl Challenge {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(76);
        v.extend_from_slice(&self.rank.to_le_bytes());
        v.extend_from_slice(&self.nonce);
        v.extend_from_slice(&self.token.to_le_bytes());
        v.extend_from_slice(&self.mac);
        v
    }
    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        let mut r = Rd { b, what: "Challenge" };
        let c = Challenge {
            rank: r.u32()?,
            nonce: r.arr32()?,
            token: r.u64()?,
            mac: r.arr32()?,
        };
        r.end()?;
        Ok(c)
    }
}

/// A 32-byte MAC payload (`Auth`).
pub fn decode_mac(b: &[u8], what: &'static str) -> Result<[u8; NONCE_LEN], FrameError> {
    let mut r = Rd { b, what };
    let m = r.arr32()?;
    r.end()?;
    Ok(m)
}

/// Client → server, first frame on the data socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataAttach {
    pub token: u64,
    pub mac: [u8; NONCE_LEN],
}

impl DataAttach {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(40);
        v.extend_from_slice(&self.token.to_le_bytes());
        v.extend_from_slice(&self.mac);
        v
    }
    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        let mut r = Rd { b, what: "DataAttach" };
        let d = DataAttach {
            token: r.u64()?,
            mac: r.arr32()?,
        };
        r.end()?;
        Ok(d)
    }
}

/// A region descriptor as carried in `Regions` frames: rkey, generation, addr, len.
pub const REGION_ENTRY_LEN: usize = 24;

/// Encodes a list of region descriptors.
pub fn encode_regions(list: &[crate::memory::RemoteRegion]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + list.len() * REGION_ENTRY_LEN);
    v.extend_from_slice(&(list.len() as u32).to_le_bytes());
    for r in list {
        v.extend_from_slice(&r.rkey.to_le_bytes());
        v.extend_from_slice(&r.generation.to_le_bytes());
        v.extend_from_slice(&r.addr.to_le_bytes());
        v.extend_from_slice(&r.len.to_le_bytes());
    }
    v
}

/// Decodes a list of region descriptors.
pub fn decode_regions(b: &[u8]) -> Result<Vec<crate::memory::RemoteRegion>, FrameError> {
    let mut r = Rd { b, what: "Regions" };
    let n = r.u32()? as usize;
    if n > (MAX_CONTROL_BYTES as usize) / REGION_ENTRY_LEN {
        return Err(FrameError::Malformed { what: "Regions" });
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(crate::memory::RemoteRegion {
            rkey: r.u32()?,
            generation: r.u32()?,
            addr: r.u64()?,
            len: r.u64()?,
        });
    }
    r.end()?;
    Ok(out)
}

/// Decodes a UTF-8 reason (`Reject`, `Nack`), replacing invalid bytes.
pub fn decode_reason(b: &[u8]) -> String {
    String::from_utf8_lossy(&b[..b.len().min(1024)]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_header() -> impl Strategy<Value = Header> {
        (
            1u8..=12,
            any::<u16>(),
            0u32..=MAX_CONTROL_BYTES,
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
        )
            .prop_map(|(k, flags, length, imm, region, generation, offset, seq)| Header {
                version: VERSION,
                kind: Kind::from_u8(k).unwrap(),
                flags,
                length,
                imm,
                region,
                generation,
                offset,
                seq,
            })
    }

    proptest! {
        #[test]
        fn header_roundtrips(h in any_header()) {
            prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
        }

        #[test]
        fn decoders_never_panic_on_any_bytes(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Header::decode(&b);
            let _ = Header::decode_any_version(&b);
            let _ = next_frame(&b, MAX_MESSAGE_BYTES);
            let _ = peek_header(&b);
            let _ = Hello::decode(&b);
            let _ = Challenge::decode(&b);
            let _ = DataAttach::decode(&b);
            let _ = decode_mac(&b, "Auth");
            let _ = decode_regions(&b);
            let _ = decode_reason(&b);
        }

        #[test]
        fn stream_split_anywhere_yields_the_same_frames(
            payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 1..8),
            cuts in proptest::collection::vec(1usize..50, 1..20),
        ) {
            let mut stream = Vec::new();
            for (i, p) in payloads.iter().enumerate() {
                let mut h = Header::new(Kind::Message, p.len() as u32);
                h.seq = i as u64;
                stream.extend_from_slice(&h.encode());
                stream.extend_from_slice(p);
            }
            // Feed the stream in arbitrary pieces, like a recv loop would.
            let mut buf = Vec::new();
            let mut got = Vec::new();
            let mut pos = 0;
            let mut ci = 0;
            while pos < stream.len() {
                let n = cuts[ci % cuts.len()].min(stream.len() - pos);
                ci += 1;
                buf.extend_from_slice(&stream[pos..pos + n]);
                pos += n;
                while let Some((h, total)) = next_frame(&buf, MAX_MESSAGE_BYTES).unwrap() {
                    got.push((h.seq, buf[HEADER_LEN..total].to_vec()));
                    buf.drain(..total);
                }
            }
            prop_assert!(buf.is_empty());
            let want: Vec<_> = payloads.iter().cloned().enumerate().map(|(i, p)| (i as u64, p)).collect();
            prop_assert_eq!(got, want);
        }

        #[test]
        fn handshake_payloads_roundtrip(job in any::<u64>(), rank in any::<u32>(), n in any::<[u8; 32]>(), tok in any::<u64>()) {
            let h = Hello { job_id: job, rank, nonce: n };
            prop_assert_eq!(Hello::decode(&h.encode()), Ok(h));
            let c = Challenge { rank, nonce: n, token: tok, mac: n };
            prop_assert_eq!(Challenge::decode(&c.encode()), Ok(c));
            let d = DataAttach { token: tok, mac: n };
            prop_assert_eq!(DataAttach::decode(&d.encode()), Ok(d));
        }
    }

    #[test]
    fn rejects_bad_magic_kind_version_and_length() {
        let mut b = Header::new(Kind::Message, 1).encode();
        b[0] ^= 0xff;
        assert!(matches!(Header::decode(&b), Err(FrameError::BadMagic(_))));
        let mut b = Header::new(Kind::Message, 1).encode();
        b[5] = 200;
        assert_eq!(Header::decode(&b), Err(FrameError::BadKind(200)));
        let mut b = Header::new(Kind::Message, 1).encode();
        b[4] = 9;
        assert_eq!(Header::decode(&b), Err(FrameError::BadVersion(9)));
        assert!(Header::decode_any_version(&b).is_ok());
        let b = Header::new(Kind::Hello, MAX_CONTROL_BYTES + 1).encode();
        assert!(matches!(Header::decode(&b), Err(FrameError::TooLong { .. })));
        let b = Header::new(Kind::Message, 100).encode();
        assert!(matches!(next_frame(&b, 10), Err(FrameError::TooLong { .. })));
        assert!(matches!(
            next_frame(b"GET / HTTP/1.1", 10),
            Err(FrameError::BadMagic(_))
        ));
        assert_eq!(next_frame(&b[..3], 10), Ok(None));
    }

    #[test]
    fn peek_header_needs_only_the_header() {
        let h = Header::new(Kind::Message, MAX_MESSAGE_BYTES);
        let b = h.encode();
        assert_eq!(peek_header(&b), Ok(Some(h)), "no payload needed");
        assert_eq!(peek_header(&b[..39]), Ok(None));
        assert!(matches!(peek_header(b"GET / HTTP/1.1"), Err(FrameError::BadMagic(_))));
    }

    #[test]
    fn regions_roundtrip_and_reject_lies() {
        let l = vec![crate::memory::RemoteRegion {
            addr: 1,
            len: 2,
            rkey: 3,
            generation: 4,
        }];
        assert_eq!(decode_regions(&encode_regions(&l)).unwrap(), l);
        // A count that promises more entries than the bytes hold.
        assert!(decode_regions(&5u32.to_le_bytes()).is_err());
        assert!(decode_regions(&u32::MAX.to_le_bytes()).is_err());
    }
}

//! The wire encoding of the rank protocol: every message one [`Node`](crate::node::Node)
//! sends to another.
//!
//! A message travels as one transport message: a `tag` (u32) and a payload.
//! The tag is `0x5457_VVKK`: the bytes `TW`, the protocol version `VV`
//! ([`VERSION`]) and the kind `KK`. Payloads are little-endian with fixed
//! layouts, every length is checked, and decoding never panics: a malformed
//! message is a [`WireError`], which the Node turns into a protocol violation
//! naming the peer.
//!
//! | kind | payload |
//! |---|---|
//! | `Hello` | version u16, field count u16, rank u32, world u32, region keys 3×u32, params base u64, largest message u64, largest write u64, then (field id u8, value u64) per field |
//! | `Credit` | count u16, then count × slot u32 (at most [`MAX_CREDITS`]) |
//! | `FactorsBegin` | layer u32, iteration u64, total bytes u64 |
//! | `FactorData` | raw bytes of U then V (f32, little-endian), one fragment |
//! | `Finished` | writes u64: the sender's worker pushes and sends nothing more; it made `writes` writes with an immediate to the receiver |
//! | `Bye` | writes u64: the sender needs nothing more and sends nothing more; likewise |
//! | `Abort` | UTF-8 reason, at most [`MAX_REASON`] bytes |
//! | `Notify` | chunk u32, version u64: the sending server applied the chunk (`--sync kvstore`) |
//! | `Pull` | chunk u32, version u64: the sending worker asks for the chunk's values (`--sync kvstore`) |
//! | `Decide` | iteration u64, SFB bits u64: worker index 0's scheme decision from that iteration on (adaptive schemes, [`crate::plan`]) |
//!
//! One-sided writes carry an immediate instead: a push names its slice (with
//! [`SPARSE_IMM`](crate::sparse::SPARSE_IMM) set for a sparse one: "sparse,
//! (len − 8) / 8 pairs"), a seeding write or a broadcast its chunk.
//!
//! Messages on one connection arrive in order, so a factor block is a
//! `FactorsBegin` followed by its `FactorData` fragments, each at most the
//! transport's message cap. Other kinds may come between fragments; a second
//! `FactorsBegin` from the same peer may not.

use crate::agree::Field;

/// The protocol version. A peer with another version is refused at hello.
///
/// Version 2 added the sparse push: a push's immediate is the slice id, with
/// [`SPARSE_IMM`](crate::sparse::SPARSE_IMM) set when the write holds
/// index/value pairs ([`crate::sparse`] gives the layout), and the write's
/// length then says how many.
///
/// Version 3 added `Notify` and `Pull`, MXNet KVStore's notification and
/// pull request ([`crate::config::SyncMode::KvStore`]).
pub const VERSION: u8 = 3;

const MAGIC: u32 = 0x5457_0000;

// The biggest control messages, a credit and a hello with every field, fit MAX_CONTROL.
const _: () = assert!(2 + 4 * MAX_CREDITS <= MAX_CONTROL && MAX_REASON <= MAX_CONTROL);
const _: () = assert!(HELLO_BYTES + 9 * crate::agree::Field::COUNT <= MAX_CONTROL);

/// Bytes of a hello before its fields.
const HELLO_BYTES: usize = 2 + 2 + 4 + 4 + 3 * 4 + 8 + 8 + 8;

/// Most slots one `Credit` message returns (it fits a 256-byte control cell).
pub const MAX_CREDITS: usize = 60;

/// Longest abort reason, in bytes (longer reasons are cut at a char boundary).
pub const MAX_REASON: usize = 240;

/// Largest encoded control message (hello, credit, factors-begin, abort).
pub const MAX_CONTROL: usize = 256;

/// Message kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// The first message on every connection: identity, configuration, region keys.
    Hello = 1,
    /// Landing slots a server returns to a worker.
    Credit = 2,
    /// A factor block starts.
    FactorsBegin = 3,
    /// A fragment of the current factor block.
    FactorData = 4,
    /// The sender's worker is done: no more pushes or factors.
    Finished = 5,
    /// The sender is done with the job.
    Bye = 6,
    /// The sender failed and says why.
    Abort = 7,
    /// A server applied a chunk (kvstore): the worker may pull it.
    Notify = 8,
    /// A worker asks a server for a chunk's values (kvstore).
    Pull = 9,
    /// Worker 0 decided the contested layers' schemes from an iteration on
    /// (adaptive schemes; only books with a decision period, which the
    /// agreed book hash names, send it, so no version bump).
    Decide = 10,
    /// A chunk's momentum follows, as `FactorData` fragments (scheme
    /// switches with SGD's momentum; only books with switches or decisions,
    /// which the agreed book hash names, send it, so no version bump).
    MomentumBegin = 11,
}

impl Kind {
    /// The transport tag of this kind, at the current version.
    pub fn tag(self) -> u32 {
        let tag = MAGIC | (u32::from(VERSION) << 8) | self as u32;
        debug_assert_eq!(kind_of(tag), Ok(self), "tag and kind_of agree");
        tag
    }

    fn from_u8(k: u8) -> Option<Kind> {
        Some(match k {
            1 => Kind::Hello,
            2 => Kind::Credit,
            3 => Kind::FactorsBegin,
            4 => Kind::FactorData,
            5 => Kind::Finished,
            6 => Kind::Bye,
            7 => Kind::Abort,
            8 => Kind::Notify,
            9 => Kind::Pull,
            10 => Kind::Decide,
            11 => Kind::MomentumBegin,
            _ => return None,
        })
        .inspect(|kind| debug_assert_eq!(*kind as u8, k))
    }
}

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The tag is not a Tidewire tag.
    #[error("tag {0:#010x} is not a Tidewire message")]
    NotTidewire(u32),
    /// The peer speaks another protocol version.
    #[error("protocol version {theirs} (this build speaks {ours})")]
    Version { theirs: u8, ours: u8 },
    /// An unknown message kind.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// The payload is shorter or longer than its layout.
    #[error("{kind:?} message of {len} bytes: {what}")]
    Length { kind: Kind, len: usize, what: &'static str },
    /// A value out of range.
    #[error("{kind:?} message: {what}")]
    Invalid { kind: Kind, what: String },
}

/// The first message on a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version.
    pub version: u16,
    /// The sender's rank.
    pub rank: u32,
    /// The sender's world size.
    pub world: u32,
    /// Opaque keys of the sender's parameter, shard and landing regions (0: none).
    pub keys: [u32; 3],
    /// Byte offset where layer 0 starts in the sender's parameter region.
    pub params_base: u64,
    /// The largest message the sender's transport takes (peers send no larger).
    pub max_message: u64,
    /// The largest write the sender's transport takes.
    pub max_write: u64,
    /// The sender's job configuration, field by field (see [`crate::agree`]).
    pub fields: Vec<(Field, u64)>,
}

/// A decoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// See [`Hello`].
    Hello(Hello),
    /// Landing slots returned.
    Credit(Vec<u32>),
    /// A factor block of `total` bytes for `layer`, iteration `iter`, follows.
    FactorsBegin { layer: u32, iter: u64, total: u64 },
    /// A fragment (the bytes are the transport message's payload).
    FactorData,
    /// The sender's worker is done; it made `writes` writes with an
    /// immediate to the receiver in all (wait for them to land: writes and
    /// messages are not ordered).
    Finished { writes: u64 },
    /// The sender is done; `writes` as for `Finished`.
    Bye { writes: u64 },
    /// The sender aborted.
    Abort(String),
    /// The sending server applied `chunk`; its values are now at `version`
    /// (iterations applied). Sent instead of the values under
    /// [`crate::book::Placement::KvStore`].
    Notify { chunk: u32, version: u64 },
    /// The sending worker asks for `chunk` at `version` (the one notified):
    /// the server answers by writing the values into its parameter buffer.
    Pull { chunk: u32, version: u64 },
    /// Worker index 0's decision: from iteration `at` on, contested layer i
    /// (in layer order) syncs by SFB where bit i of `sfb` is set, else by the PS.
    Decide { at: u64, sfb: u64 },
    /// `chunk`'s momentum (`total` bytes, the chunk's f32s) follows as
    /// `FactorData` fragments, for the switch at `iter`: worker index 0's to
    /// the chunk's server where its layer comes back to the PS
    /// (`to_server`), or the chunk's server's to a worker where the layer
    /// leaves the PS.
    MomentumBegin {
        chunk: u32,
        iter: u64,
        total: u64,
        to_server: bool,
    },
}

struct Reader<'a> {
    b: &'a [u8],
    kind: Kind,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], WireError> {
        if self.b.len() < N {
            return Err(WireError::Length {
                kind: self.kind,
                len: self.b.len(),
                what,
            });
        }
        let (h, t) = self.b.split_at(N);
        self.b = t;
        let mut out = [0u8; N];
        out.copy_from_slice(h);
        Ok(out)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take::<1>(what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.take(what)?))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(what)?))
    }
    /// A hello's fields (`whole`: the payload's length, for the error).
    fn hello(&mut self, whole: usize) -> Result<Hello, WireError> {
        let kind = self.kind;
        let version = self.u16("version")?;
        let n = self.u16("field count")? as usize;
        let rank = self.u32("rank")?;
        let world = self.u32("world")?;
        let keys = [self.u32("key")?, self.u32("key")?, self.u32("key")?];
        let params_base = self.u64("params base")?;
        let max_message = self.u64("largest message")?;
        let max_write = self.u64("largest write")?;
        if self.b.len() != n * 9 {
            return Err(WireError::Length {
                kind,
                len: whole,
                what: "field count disagrees with the length",
            });
        }
        let mut fields = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.u8("field id")?;
            let v = self.u64("field value")?;
            let f = Field::from_id(id).ok_or_else(|| WireError::Invalid {
                kind,
                what: format!("unknown configuration field {id}"),
            })?;
            fields.push((f, v));
        }
        // The count agreed with the length: every byte is read.
        debug_assert!(self.b.is_empty(), "{} bytes left", self.b.len());
        Ok(Hello {
            version,
            rank,
            world,
            keys,
            params_base,
            max_message,
            max_write,
            fields,
        })
    }

    /// A credit message's slots (`whole`: the payload's length, for the error).
    fn credits(&mut self, whole: usize) -> Result<Vec<u32>, WireError> {
        let n = self.u16("count")? as usize;
        if n == 0 || n > MAX_CREDITS || self.b.len() != n * 4 {
            return Err(WireError::Length {
                kind: self.kind,
                len: whole,
                what: "count disagrees with the length, or is 0 or over 60",
            });
        }
        let mut slots = Vec::with_capacity(n);
        for _ in 0..n {
            slots.push(self.u32("slot")?);
        }
        // The count agreed with the length: every byte is read.
        debug_assert!(self.b.is_empty(), "{} bytes left", self.b.len());
        debug_assert!(!slots.is_empty() && slots.len() <= MAX_CREDITS);
        Ok(slots)
    }

    fn end(&self) -> Result<(), WireError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(WireError::Length {
                kind: self.kind,
                len: self.b.len(),
                what: "trailing bytes",
            })
        }
    }
}

/// The kind a tag names, checking the magic and the version.
pub fn kind_of(tag: u32) -> Result<Kind, WireError> {
    if tag & 0xffff_0000 != MAGIC {
        return Err(WireError::NotTidewire(tag));
    }
    let v = ((tag >> 8) & 0xff) as u8;
    if v != VERSION {
        return Err(WireError::Version {
            theirs: v,
            ours: VERSION,
        });
    }
    let k = (tag & 0xff) as u8;
    Kind::from_u8(k).ok_or(WireError::UnknownKind(k))
}

/// An abort's reason: the whole payload, UTF-8, at most [`MAX_REASON`] bytes.
fn abort_reason(data: &[u8]) -> Result<String, WireError> {
    let kind = Kind::Abort;
    if data.len() > MAX_REASON {
        return Err(WireError::Length {
            kind,
            len: data.len(),
            what: "reason over 240 bytes",
        });
    }
    let s = std::str::from_utf8(data).map_err(|_| WireError::Invalid {
        kind,
        what: "reason is not UTF-8".into(),
    })?;
    debug_assert!(s.len() <= MAX_REASON);
    Ok(s.to_string())
}

/// Decodes one message. `FactorData` carries no decoded fields: its bytes are the payload.
pub fn decode(tag: u32, data: &[u8]) -> Result<Msg, WireError> {
    let kind = kind_of(tag)?;
    let mut r = Reader { b: data, kind };
    let msg = match kind {
        Kind::Hello => Msg::Hello(r.hello(data.len())?),
        Kind::Credit => Msg::Credit(r.credits(data.len())?),
        Kind::FactorsBegin => Msg::FactorsBegin {
            layer: r.u32("layer")?,
            iter: r.u64("iteration")?,
            total: r.u64("total")?,
        },
        Kind::FactorData => return Ok(Msg::FactorData),
        Kind::Finished => Msg::Finished {
            writes: r.u64("writes")?,
        },
        Kind::Bye => Msg::Bye {
            writes: r.u64("writes")?,
        },
        Kind::Notify => Msg::Notify {
            chunk: r.u32("chunk")?,
            version: r.u64("version")?,
        },
        Kind::Pull => Msg::Pull {
            chunk: r.u32("chunk")?,
            version: r.u64("version")?,
        },
        Kind::Decide => Msg::Decide {
            at: r.u64("iteration")?,
            sfb: r.u64("bits")?,
        },
        Kind::MomentumBegin => Msg::MomentumBegin {
            chunk: r.u32("chunk")?,
            iter: r.u64("iteration")?,
            total: r.u64("total")?,
            to_server: match r.u8("direction")? {
                0 => false,
                1 => true,
                d => {
                    return Err(WireError::Invalid {
                        kind,
                        what: format!("direction {d} (0: to a worker, 1: to the server)"),
                    })
                }
            },
        },
        Kind::Abort => return Ok(Msg::Abort(abort_reason(data)?)),
    };
    r.end()?;
    // Only canonical bytes decode: they are what `encode` makes of the message.
    debug_assert_eq!(encode(&msg), (tag, data.to_vec()), "{msg:?}");
    Ok(msg)
}

/// Appends a hello's fixed part, then its fields (id, value), to the empty `b`.
fn put_hello(b: &mut Vec<u8>, h: &Hello) {
    debug_assert!(b.is_empty(), "a hello starts its payload");
    b.extend_from_slice(&h.version.to_le_bytes());
    b.extend_from_slice(&(h.fields.len() as u16).to_le_bytes());
    b.extend_from_slice(&h.rank.to_le_bytes());
    b.extend_from_slice(&h.world.to_le_bytes());
    for k in h.keys {
        b.extend_from_slice(&k.to_le_bytes());
    }
    b.extend_from_slice(&h.params_base.to_le_bytes());
    b.extend_from_slice(&h.max_message.to_le_bytes());
    b.extend_from_slice(&h.max_write.to_le_bytes());
    debug_assert_eq!(b.len(), HELLO_BYTES);
    for (f, v) in &h.fields {
        b.push(*f as u8);
        b.extend_from_slice(&v.to_le_bytes());
    }
}

/// Encodes a control message (every kind but `FactorData`, whose bytes are
/// the factors themselves). Returns the tag and the payload.
pub fn encode(msg: &Msg) -> (u32, Vec<u8>) {
    let mut b = Vec::with_capacity(64);
    let kind = match msg {
        Msg::Hello(h) => {
            put_hello(&mut b, h);
            Kind::Hello
        }
        Msg::Credit(slots) => {
            debug_assert!(!slots.is_empty() && slots.len() <= MAX_CREDITS);
            b.extend_from_slice(&(slots.len() as u16).to_le_bytes());
            for s in slots {
                b.extend_from_slice(&s.to_le_bytes());
            }
            Kind::Credit
        }
        Msg::FactorsBegin { layer, iter, total } => {
            b.extend_from_slice(&layer.to_le_bytes());
            b.extend_from_slice(&iter.to_le_bytes());
            b.extend_from_slice(&total.to_le_bytes());
            Kind::FactorsBegin
        }
        Msg::FactorData => Kind::FactorData,
        Msg::Finished { writes } => {
            b.extend_from_slice(&writes.to_le_bytes());
            Kind::Finished
        }
        Msg::Bye { writes } => {
            b.extend_from_slice(&writes.to_le_bytes());
            Kind::Bye
        }
        Msg::Notify { chunk, version } => {
            b.extend_from_slice(&chunk.to_le_bytes());
            b.extend_from_slice(&version.to_le_bytes());
            Kind::Notify
        }
        Msg::Pull { chunk, version } => {
            b.extend_from_slice(&chunk.to_le_bytes());
            b.extend_from_slice(&version.to_le_bytes());
            Kind::Pull
        }
        Msg::Decide { at, sfb } => {
            b.extend_from_slice(&at.to_le_bytes());
            b.extend_from_slice(&sfb.to_le_bytes());
            Kind::Decide
        }
        Msg::MomentumBegin {
            chunk,
            iter,
            total,
            to_server,
        } => {
            b.extend_from_slice(&chunk.to_le_bytes());
            b.extend_from_slice(&iter.to_le_bytes());
            b.extend_from_slice(&total.to_le_bytes());
            b.push(u8::from(*to_server));
            Kind::MomentumBegin
        }
        Msg::Abort(reason) => {
            let mut end = reason.len().min(MAX_REASON);
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            b.extend_from_slice(&reason.as_bytes()[..end]);
            Kind::Abort
        }
    };
    // A hello's size depends on its fields; every other control message fits a cell.
    debug_assert!(
        matches!(msg, Msg::Hello(_)) || b.len() <= MAX_CONTROL,
        "{kind:?} of {} bytes",
        b.len()
    );
    (kind.tag(), b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_msg() -> impl Strategy<Value = Msg> {
        let field = (0u8..Field::COUNT as u8).prop_map(|i| Field::from_id(i).expect("in range"));
        prop_oneof![
            (
                any::<u16>(),
                any::<u32>(),
                any::<u32>(),
                any::<[u32; 3]>(),
                any::<u64>(),
                any::<(u64, u64)>(),
                proptest::collection::vec((field, any::<u64>()), 0..18)
            )
                .prop_map(
                    |(version, rank, world, keys, params_base, (max_message, max_write), fields)| Msg::Hello(Hello {
                        version,
                        rank,
                        world,
                        keys,
                        params_base,
                        max_message,
                        max_write,
                        fields
                    })
                ),
            proptest::collection::vec(any::<u32>(), 1..=MAX_CREDITS).prop_map(Msg::Credit),
            (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(layer, iter, total)| Msg::FactorsBegin {
                layer,
                iter,
                total
            }),
            any::<u64>().prop_map(|writes| Msg::Finished { writes }),
            any::<u64>().prop_map(|writes| Msg::Bye { writes }),
            (any::<u32>(), any::<u64>()).prop_map(|(chunk, version)| Msg::Notify { chunk, version }),
            (any::<u32>(), any::<u64>()).prop_map(|(chunk, version)| Msg::Pull { chunk, version }),
            (any::<u64>(), any::<u64>()).prop_map(|(at, sfb)| Msg::Decide { at, sfb }),
            (any::<u32>(), any::<u64>(), any::<u64>(), any::<bool>()).prop_map(|(chunk, iter, total, to_server)| {
                Msg::MomentumBegin {
                    chunk,
                    iter,
                    total,
                    to_server,
                }
            }),
            "[a-zA-Z0-9 ,.:é]{0,80}".prop_map(Msg::Abort),
        ]
    }

    proptest! {
        #[test]
        fn every_message_round_trips(m in arb_msg()) {
            let (tag, bytes) = encode(&m);
            prop_assert!(bytes.len() <= MAX_CONTROL, "{} bytes", bytes.len());
            prop_assert_eq!(decode(tag, &bytes).unwrap(), m);
        }

        #[test]
        fn decoding_never_panics(tag_kind in 0u8..13, version in prop_oneof![Just(VERSION), any::<u8>()],
                                 magic in prop_oneof![Just(MAGIC), any::<u32>()],
                                 data in proptest::collection::vec(any::<u8>(), 0..400)) {
            let tag = (magic & 0xffff_0000) | (u32::from(version) << 8) | u32::from(tag_kind);
            let _ = decode(tag, &data);
        }

        #[test]
        fn truncations_and_extensions_are_errors(m in arb_msg(), cut in 0usize..64, extra in 1usize..8) {
            let (tag, bytes) = encode(&m);
            if !matches!(m, Msg::Abort(_)) {
                if cut < bytes.len() {
                    prop_assert!(decode(tag, &bytes[..cut]).is_err());
                }
                let mut longer = bytes.clone();
                longer.extend(std::iter::repeat(0).take(extra));
                prop_assert!(decode(tag, &longer).is_err());
            }
        }
    }

    #[test]
    fn tags_carry_magic_version_and_kind() {
        assert_eq!(kind_of(Kind::Bye.tag()), Ok(Kind::Bye));
        assert_eq!(kind_of(7), Err(WireError::NotTidewire(7)));
        let other = MAGIC | (u32::from(VERSION + 1) << 8) | 2;
        assert!(matches!(kind_of(other), Err(WireError::Version { .. })));
        assert_eq!(
            kind_of(MAGIC | (u32::from(VERSION) << 8) | 99),
            Err(WireError::UnknownKind(99))
        );
    }

    #[test]
    fn long_abort_reasons_are_cut_at_a_char_boundary() {
        let reason = "é".repeat(200);
        let (tag, b) = encode(&Msg::Abort(reason));
        assert!(b.len() <= MAX_REASON);
        assert!(matches!(decode(tag, &b), Ok(Msg::Abort(s)) if s.chars().all(|c| c == 'é')));
    }
}

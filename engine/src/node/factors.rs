//! Sufficient factors on their way in: reassembly of each peer's factor
//! block from its fragments, and the store of every worker's block per
//! (layer, iteration) until the reconstruction takes them.
//!
//! Bounds: one open block per peer; blocks are kept only for iterations not
//! yet reconstructed (at most `s + 1` per layer under SSP(s)).
//!
//! No copy: a fragment's buffer (the transport's message) is moved in and
//! kept as it came. A block that arrives in one message becomes
//! [`Blob::Bytes`] of that very buffer; one that arrives in several becomes
//! [`Blob::Fragments`], never concatenated. The reconstruction reads the f32
//! values in place ([`Blob::f32s`]).

use super::types::{Blob, Payload};
use crate::error::ProtocolViolation;
use crate::fxhash::FxHashMap as HashMap;

/// How a sender cuts a factor block of `total` bytes whose U takes the first
/// `u` to a message cap of `cap` bytes: `(offset, length)` of each fragment,
/// in order. A block that fits is one fragment. A larger one is cut at the
/// U/V boundary, then into pieces of the cap rounded down to whole f32s, so
/// U, and V, lies in one fragment whenever it fits a message alone and the
/// receiver reads it there (at most one message more than cutting blindly).
/// Receivers accept any cut.
pub fn fragments(u: u64, total: u64, cap: u64) -> impl Iterator<Item = (u64, u64)> {
    let (frag, split) = if total <= cap {
        (total, total)
    } else {
        ((cap / 4 * 4).max(4), u.min(total))
    };
    let mut off = 0;
    std::iter::from_fn(move || {
        if off >= total {
            return None;
        }
        let end = if off < split { split } else { total };
        let n = (end - off).min(frag);
        // Every fragment makes progress and fits the cap (4 bytes at least).
        debug_assert!(
            n > 0 && n <= cap.max(4) && off + n <= total,
            "fragment {off}+{n} of {total}, cap {cap}"
        );
        off += n;
        Some((off - n, n))
    })
}

/// What a block of fragments carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Block {
    /// A worker's sufficient factors of `layer`.
    Factors { layer: u32 },
    /// A chunk's momentum at a scheme switch ([`crate::wire::Msg::MomentumBegin`]).
    Momentum { chunk: u32, to_server: bool },
}

#[derive(Debug)]
struct Stream {
    block: Block,
    iter: u64,
    total: usize,
    got: usize,
    /// The fragments as they came; `None` once one came as
    /// `Payload::Opaque` (simulation).
    pieces: Option<Vec<Vec<u8>>>,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Inbox {
    open: Vec<Option<Stream>>,
    store: HashMap<(u32, u64), Vec<Option<Blob>>>,
    p1: usize,
    held: usize,
    max_held: usize,
}

impl Inbox {
    pub(crate) fn new(world: usize, p1: usize) -> Self {
        Inbox {
            open: (0..world).map(|_| None).collect(),
            store: HashMap::default(),
            p1,
            held: 0,
            max_held: 0,
        }
    }

    /// A block of `total` bytes from `peer` starts.
    pub(crate) fn begin(&mut self, peer: u32, block: Block, iter: u64, total: usize) -> Result<(), ProtocolViolation> {
        let slot = &mut self.open[peer as usize];
        if let Some(s) = slot {
            let name = |b: Block| match b {
                Block::Factors { layer } => format!("factors of layer {layer}"),
                Block::Momentum { chunk, .. } => format!("momentum of chunk {chunk}"),
            };
            return Err(ProtocolViolation::FactorBlockOverlap {
                block: name(block),
                open: name(s.block),
                open_iter: s.iter,
            });
        }
        *slot = Some(Stream {
            block,
            iter,
            total,
            got: 0,
            pieces: Some(Vec::new()),
        });
        Ok(())
    }

    /// A fragment from `peer`. Returns the block when it is complete.
    pub(crate) fn data(&mut self, peer: u32, data: Payload) -> Result<Option<(Block, u64, Blob)>, ProtocolViolation> {
        let slot = &mut self.open[peer as usize];
        let Some(s) = slot.as_mut() else {
            return Err(ProtocolViolation::FactorDataWithoutBlock);
        };
        let n = data.len();
        if n == 0 || s.got + n > s.total {
            return Err(ProtocolViolation::FactorFragmentOverrun {
                bytes: n,
                at: s.got,
                total: s.total,
            });
        }
        s.got += n;
        match data {
            Payload::Bytes(b) => {
                if let Some(v) = s.pieces.as_mut() {
                    v.push(b);
                }
            }
            Payload::Opaque(_) => s.pieces = None,
        }
        if s.got < s.total {
            return Ok(None);
        }
        let s = slot.take().expect("open");
        debug_assert_eq!(s.got, s.total);
        let blob = match s.pieces {
            Some(mut p) if p.len() == 1 => Blob::Bytes(p.pop().expect("one")),
            Some(p) => Blob::Fragments(p),
            None => Blob::Opaque(s.total),
        };
        debug_assert_eq!(blob.len(), s.total, "the block is its fragments, whole");
        Ok(Some((s.block, s.iter, blob)))
    }

    /// Stores worker index `wi`'s block.
    pub(crate) fn put(&mut self, layer: u32, iter: u64, wi: usize, blob: Blob) -> Result<(), ProtocolViolation> {
        let e = self.store.entry((layer, iter)).or_insert_with(|| vec![None; self.p1]);
        if e[wi].is_some() {
            return Err(ProtocolViolation::SecondFactorBlock { layer, iter });
        }
        e[wi] = Some(blob);
        self.held += 1;
        self.max_held = self.max_held.max(self.held);
        self.debug_invariants();
        Ok(())
    }

    /// Every worker's block, in worker order, once all are here.
    pub(crate) fn take(&mut self, layer: u32, iter: u64) -> Option<Vec<Blob>> {
        let e = self.store.get(&(layer, iter))?;
        if e.iter().any(Option::is_none) {
            return None;
        }
        let e = self.store.remove(&(layer, iter)).expect("present");
        debug_assert!(e.len() == self.p1 && self.held >= e.len());
        self.held -= e.len();
        self.debug_invariants();
        Some(e.into_iter().map(|b| b.expect("checked")).collect())
    }

    /// `held` counts the blocks stored (O(blocks stored)).
    fn debug_invariants(&self) {
        debug_assert_eq!(
            self.held,
            self.store.values().map(|e| e.iter().flatten().count()).sum::<usize>()
        );
        debug_assert!(self.held <= self.max_held && self.store.values().all(|e| e.len() == self.p1));
    }

    /// Blocks held now (for the memory bound).
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held
    }
    /// Most blocks held at once.
    pub(crate) fn max_held(&self) -> usize {
        self.max_held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_reassemble_in_order_and_misuse_is_refused() {
        let mut ib = Inbox::new(3, 2);
        assert!(ib.data(1, Payload::Bytes(vec![1])).is_err());
        ib.begin(1, Block::Factors { layer: 4 }, 0, 5).unwrap();
        assert!(
            ib.begin(1, Block::Factors { layer: 4 }, 1, 5).is_err(),
            "one open block per peer"
        );
        assert_eq!(ib.data(1, Payload::Bytes(vec![1, 2, 3])).unwrap(), None);
        assert!(ib.data(1, Payload::Bytes(vec![0; 3])).is_err(), "overrun");
        let (l, i, b) = ib.data(1, Payload::Bytes(vec![4, 5])).unwrap().unwrap();
        assert_eq!(
            (l, i, b),
            (
                Block::Factors { layer: 4 },
                0,
                Blob::Fragments(vec![vec![1, 2, 3], vec![4, 5]])
            )
        );
        ib.put(4, 0, 1, Blob::Bytes(vec![9])).unwrap();
        assert!(ib.take(4, 0).is_none());
        assert!(ib.put(4, 0, 1, Blob::Opaque(1)).is_err());
        ib.put(4, 0, 0, Blob::Opaque(5)).unwrap();
        assert_eq!(ib.take(4, 0).unwrap().len(), 2);
        assert_eq!(ib.held(), 0);
    }

    use crate::testkit::next;

    fn seed() -> u64 {
        crate::testkit::seed("TIDEWIRE_FACTOR_SEED")
    }

    #[test]
    fn a_block_in_one_message_is_that_message_s_buffer() {
        let mut ib = Inbox::new(2, 2);
        let vals: Vec<f32> = (0..40).map(|i| i as f32 * 0.25 - 3.0).collect();
        let msg: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
        let at = msg.as_ptr();
        ib.begin(1, Block::Factors { layer: 0 }, 7, msg.len()).unwrap();
        let (_, _, blob) = ib.data(1, Payload::Bytes(msg)).unwrap().unwrap();
        let Blob::Bytes(b) = &blob else {
            panic!("a whole block must stay one buffer: {blob:?}")
        };
        assert_eq!(b.as_ptr(), at, "the block was copied");
        // The allocator's buffers are 4-byte aligned, so U and V are read in place.
        let (mut su, mut sv) = (Vec::new(), Vec::new());
        let (u, decoded) = blob.f32s(0, 16, &mut su).unwrap();
        assert!(!decoded);
        assert_eq!(u.as_ptr().cast::<u8>(), at, "U is not read in the received buffer");
        let (v, decoded) = blob.f32s(64, 24, &mut sv).unwrap();
        assert!(!decoded);
        assert_eq!(v.as_ptr().cast::<u8>(), at.wrapping_add(64));
        assert_eq!([u, v].concat(), vals);
        assert_eq!(su.capacity() + sv.capacity(), 0, "nothing was decoded");
    }

    #[test]
    fn fragments_are_kept_as_they_came_never_concatenated() {
        let seed = seed();
        let mut rng = seed;
        for case in 0..300 {
            let total = 1 + (next(&mut rng) % 600) as usize;
            let bytes: Vec<u8> = (0..total).map(|_| next(&mut rng) as u8).collect();
            let mut cuts: Vec<usize> = (0..next(&mut rng) % 6)
                .map(|_| 1 + (next(&mut rng) as usize) % total)
                .collect();
            cuts.push(total);
            cuts.sort_unstable();
            cuts.dedup();
            let mut ib = Inbox::new(1, 1);
            ib.begin(
                0,
                Block::Momentum {
                    chunk: 3,
                    to_server: case % 2 == 0,
                },
                case,
                total,
            )
            .unwrap();
            let (mut sent, mut from, mut blob) = (Vec::new(), 0, None);
            for &c in &cuts {
                let frag = bytes[from..c].to_vec();
                sent.push((frag.as_ptr(), frag.len()));
                let r = ib.data(0, Payload::Bytes(frag)).unwrap();
                assert_eq!(r.is_some(), c == total, "seed {seed} case {case}");
                blob = r.map(|(_, _, b)| b);
                from = c;
            }
            let blob = blob.unwrap();
            assert_eq!(
                matches!(blob, Blob::Bytes(_)),
                cuts.len() == 1,
                "seed {seed} case {case}: {blob:?}"
            );
            let kept: Vec<_> = blob.pieces().iter().map(|p| (p.as_ptr(), p.len())).collect();
            assert_eq!(kept, sent, "seed {seed} case {case}: fragments copied or merged");
            assert_eq!(blob.pieces().concat(), bytes);
            // Any range of f32 reads back the same bits as decoding the whole
            // block, in place exactly when it lies in one aligned fragment.
            let mut scratch = Vec::new();
            for _ in 0..20 {
                let at = (next(&mut rng) as usize) % total;
                let count = (next(&mut rng) as usize) % ((total - at) / 4 + 1);
                let want: Vec<u32> = bytes[at..at + count * 4]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                let (got, decoded) = blob.f32s(at, count, &mut scratch).unwrap();
                let got: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                assert_eq!(got, want, "seed {seed} case {case}: {count} values at {at}");
                let mut start = 0;
                let one = blob.pieces().iter().find_map(|p| {
                    let s = start;
                    start += p.len();
                    (at >= s && at + count * 4 <= start).then(|| p.as_ptr() as usize + at - s)
                });
                let in_place = one.is_some_and(|a| a % 4 == 0) && cfg!(target_endian = "little");
                assert_eq!(decoded, !in_place, "seed {seed} case {case}: {count} values at {at}");
            }
            assert!(blob.f32s(total - total % 4, 1 + total % 4, &mut scratch).is_none());
        }
    }

    #[test]
    fn senders_cut_at_the_u_v_boundary_and_on_whole_f32s() {
        let cut = |u, total, cap| fragments(u, total, cap).collect::<Vec<_>>();
        assert_eq!(cut(40, 100, 100), [(0, 100)]);
        assert_eq!(cut(40, 100, 99), [(0, 40), (40, 60)]);
        assert_eq!(cut(40, 100, 50), [(0, 40), (40, 48), (88, 12)]);
        assert_eq!(cut(400, 480, 257), [(0, 256), (256, 144), (400, 80)]);
        // fc6 of VGG19 at K = 32 to 64 KiB messages: 49 + 8 fragments.
        let (u, v) = (32 * 25088 * 4, 32 * 4096 * 4);
        assert_eq!(fragments(u, u + v, 65536).count(), 57);
        for (u, total, cap) in [(4, 8, 4), (1000, 4000, 333), (0, 44, 8), (44, 44, 8)] {
            let c = cut(u, total, cap);
            assert!(c.iter().all(|&(_, n)| n > 0 && n <= cap), "{c:?}");
            assert!(c.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0) && c[0].0 == 0, "{c:?}");
            assert_eq!(c.last().map(|&(o, n)| o + n), Some(total));
        }
    }
}

//! Nexus's sparse-vector push: the encoding of a sparse gradient slice, the
//! reference kernels that encode and densify it, and the cost model that
//! picks sparse or dense per slice.
//!
//! # Which layers
//! The application marks a layer sparse ([`LayerSpec::sparse()`](crate::book::LayerSpec::sparse());
//! in Python, the parameters of `nn.Embedding(sparse=True)`). The mark is part
//! of the layer table every rank agrees on at rendezvous. Only layers that sync
//! through the parameter server can be sparse (sufficient factors are a
//! compressed form already): a sparse FC layer always goes to the PS.
//!
//! # The encoding
//! A slice of `len` f32 elements goes either dense (its `4·len` bytes, as
//! every other slice) or as index/value pairs:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | pairs `n`, u32 LE |
//! | 4..8 | the slice's length `len`, u32 LE |
//! | 8.. | `n` × (index u32 LE, value bits u32 LE), indices strictly increasing, each `< len` |
//!
//! An element is left out exactly when its bits are those of `+0.0`: a `-0.0`
//! or a NaN is a pair like any other value. The write carries the immediate
//! `slice | SPARSE_IMM` ([`SPARSE_IMM`]), and its length (`8 + 8n`) says how
//! many pairs it holds; the receiver checks it against the header. The header
//! makes an empty slice (`n = 0`) an 8-byte write rather than an empty one.
//!
//! # Exactness
//! A server turns a sparse contribution back into the dense slice
//! ([`densify`]: zeros, then the pairs) and aggregates that exactly as it
//! aggregates a dense one: the same kernel on the same bits, whether `first`
//! (a copy) or not (an add), in worker order under the deterministic mode. So
//! the result is bitwise the dense path's; `acc + (+0.0)` included (it turns an
//! accumulator's `-0.0` into `+0.0`, so skipping it would not be exact).
//!
//! # The cost model ([`SparseCosts`])
//! For a slice of `len` elements with `n` nonzeros on a link of `B` bytes/s:
//!
//! - dense: `4·len / B + copy·len` (the server copies a landing slot out before
//!   it sums it);
//! - sparse: `(encode + densify)·len + (encode_pair + densify_pair)·n + (8 + 8n) / B`;
//!
//! where `encode`, `densify` and `copy` are measured costs in ns per element
//! of the slice and `encode_pair`, `densify_pair` in ns per pair
//! (`tidewire_gpu::cpu::calibrate_sparse`, which the runtime runs at
//! start-up: an empty slice gives the per-element costs, one with 10% of its
//! elements nonzero in rows of 64, as an embedding's gradient has them, the
//! per-pair ones; scattered nonzeros cost the encoder more per pair). Sparse pays while `n ≤ cap`, the largest `n` with sparse no
//! slower than dense ([`SparseCosts::max_pairs`]): the density threshold is
//! `cap / len`, which falls as the link gets faster. The worker's encode job
//! stops as soon as it has seen more than `cap` nonzeros and the slice goes
//! dense. [`SparsePolicy`] remembers, per slice, that the last try was over
//! the cap and sends the slice dense without a try for the next
//! [`SparsePolicy::REPROBE`] − 1 pushes, so that a dense layer marked sparse
//! costs at most one partial scan every [`SparsePolicy::REPROBE`] pushes.

use crate::book::Book;

/// Bit of a push's immediate that says the write holds pairs (slice ids stay
/// below it: [`crate::book::MAX_SLICES`]).
pub const SPARSE_IMM: u32 = crate::book::MAX_SLICES;
/// Bytes of the header of an encoded slice.
pub const HEADER_BYTES: usize = 8;
/// Bytes per index/value pair.
pub const PAIR_BYTES: usize = 8;

/// Bytes of a slice encoded with `pairs` pairs.
pub fn encoded_bytes(pairs: usize) -> usize {
    HEADER_BYTES + pairs * PAIR_BYTES
}

/// The most pairs a slice of `len` elements may carry: its encoding must fit
/// a landing slot (and be smaller than the dense slice).
pub fn pair_limit(len: usize) -> usize {
    let n = (len * 4).saturating_sub(HEADER_BYTES + 1) / PAIR_BYTES;
    // Smaller than the dense slice, from 3 elements up (below, the header alone is not).
    debug_assert!(
        len < 3 || encoded_bytes(n) < len * 4,
        "{n} pairs of a {len}-element slice"
    );
    n
}

/// Whether an element goes as a pair: every value but `+0.0`, by its bits.
#[inline(always)]
pub fn is_pair(v: f32) -> bool {
    v.to_bits() != 0
}

/// Appends the pairs of `src` (indices from `base`) to `out` as u32 words
/// (index, value bits), stopping once more than `cap` pairs are in `out`.
/// Returns whether it finished (`false`: over the cap; `out` then holds
/// `cap + 1` pairs). Runs of 64 `+0.0`s are skipped after one vectorized OR;
/// elsewhere the loop is branch-free per element: it writes every element's
/// pair into a buffer on the stack and advances only over nonzeros.
pub fn encode_into(src: &[f32], base: u32, cap: usize, out: &mut Vec<u32>) -> bool {
    const RUN: usize = 64;
    let mut n = out.len() / 2;
    let mut buf = [0u32; 2 * RUN];
    for (k, run) in src.chunks(RUN).enumerate() {
        // Runs of zeros (an embedding's untouched rows) cost one OR over
        // their bits, which the compiler vectorizes.
        if run.iter().fold(0u32, |a, v| a | v.to_bits()) == 0 {
            continue;
        }
        let first = base + (k * RUN) as u32;
        let mut m = 0;
        for (i, &v) in run.iter().enumerate() {
            buf[2 * m] = first + i as u32;
            buf[2 * m + 1] = v.to_bits();
            m += usize::from(is_pair(v));
        }
        // Indices strictly increase, run after run (the receiver checks it).
        debug_assert!(m == 0 || out.len() < 2 || out[out.len() - 2] < buf[0]);
        out.extend_from_slice(&buf[..2 * m]);
        n += m;
        debug_assert_eq!(out.len(), 2 * n, "two words a pair");
        if n > cap {
            out.truncate(2 * (cap + 1));
            debug_assert_eq!(out.len(), 2 * (cap + 1));
            return false;
        }
    }
    true
}

/// Encodes `src` whole (header then pairs) into `out` (cleared first), unless
/// it has more than `cap` nonzeros: then `None`. The single-threaded reference;
/// `tidewire_gpu::cpu::sparse_encode` is the same bytes on several threads.
pub fn encode(src: &[f32], cap: usize, out: &mut Vec<u8>) -> Option<usize> {
    let mut words = Vec::new();
    if !encode_into(src, 0, cap.min(pair_limit(src.len())), &mut words) {
        return None;
    }
    let n = words.len() / 2;
    out.clear();
    out.extend_from_slice(&header(n, src.len()));
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
    // The write's length says how many pairs it holds, as the header does.
    debug_assert_eq!(out.len(), encoded_bytes(n));
    Some(n)
}

/// The header bytes of an encoded slice.
pub fn header(pairs: usize, len: usize) -> [u8; HEADER_BYTES] {
    debug_assert!(pairs <= len && u32::try_from(len).is_ok(), "{pairs} pairs of {len}");
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(&(pairs as u32).to_le_bytes());
    h[4..].copy_from_slice(&(len as u32).to_le_bytes());
    h
}

/// Why an encoded slice cannot be densified (a peer that broke the format).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SparseError {
    /// The header disagrees with the write's length or the slice's.
    #[error("sparse slice header says {pairs} pairs of a {len}-element slice; the write holds {want_pairs} pairs of a {want_len}-element slice")]
    Header {
        pairs: u32,
        len: u32,
        want_pairs: usize,
        want_len: usize,
    },
    /// An index out of range, or not above the one before it.
    #[error("sparse pair {at}: index {index} (previous {prev:?}, slice length {len})")]
    Index {
        at: usize,
        index: u32,
        prev: Option<u32>,
        len: usize,
    },
}

/// Checks the header (`words[0..2]`) against `pairs` and `len`.
pub fn check_header(words: &[u32], pairs: usize, len: usize) -> Result<(), SparseError> {
    let (p, l) = (
        words.first().copied().unwrap_or(u32::MAX),
        words.get(1).copied().unwrap_or(0),
    );
    if words.len() != 2 + 2 * pairs || p as usize != pairs || l as usize != len {
        return Err(SparseError::Header {
            pairs: p,
            len: l,
            want_pairs: pairs,
            want_len: len,
        });
    }
    Ok(())
}

/// Writes the pairs (`pairs` as u32 words, index then value bits) whose
/// indices fall in `lo..lo + out.len()` into `out` (which holds zeros),
/// checking that indices are strictly increasing and below `len`. `prev` is the
/// index of the pair before `pairs[0]` in the slice, if any, and `first` that
/// pair's position (for errors).
pub fn scatter_range(
    pairs: &[u32],
    first: usize,
    prev: Option<u32>,
    lo: usize,
    len: usize,
    out: &mut [f32],
) -> Result<(), SparseError> {
    // The caller cuts whole pairs, and a window of the slice.
    debug_assert!(
        pairs.len() % 2 == 0 && lo + out.len() <= len,
        "{} words at {lo}+{}",
        pairs.len(),
        out.len()
    );
    let mut last = prev;
    for (k, p) in pairs.chunks_exact(2).enumerate() {
        let (i, v) = (p[0], p[1]);
        let bad = (i as usize) >= len || last.is_some_and(|l| i <= l);
        let slot = (i as usize).checked_sub(lo).filter(|&j| j < out.len());
        match slot {
            Some(j) if !bad => out[j] = f32::from_bits(v),
            _ => {
                return Err(SparseError::Index {
                    at: first + k,
                    index: i,
                    prev: last,
                    len,
                })
            }
        }
        last = Some(i);
    }
    Ok(())
}

/// Turns an encoded slice (`words`: header then pairs, as u32 words) of
/// `pairs` pairs back into its `out.len()` dense elements: exactly the bits
/// the sender encoded (the single-threaded reference of
/// `tidewire_gpu::cpu::sparse_densify`). Never panics on hostile input.
pub fn densify(words: &[u32], pairs: usize, out: &mut [f32]) -> Result<(), SparseError> {
    check_header(words, pairs, out.len())?;
    out.fill(0.0);
    let len = out.len();
    scatter_range(&words[2..], 0, None, 0, len, out)?;
    // Only the pairs' places hold anything but +0.0.
    debug_assert!(out.iter().filter(|v| is_pair(**v)).count() <= pairs);
    Ok(())
}

/// Measured costs of the two forms of a push, and the link they cross.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SparseCosts {
    /// The link's bandwidth, bytes per second.
    pub link_bytes_per_s: f64,
    /// Worker: encoding, ns per element of the slice (the scan).
    pub encode_ns_per_elem: f64,
    /// Worker: encoding, ns per pair written.
    pub encode_ns_per_pair: f64,
    /// Server: densifying a sparse slot, ns per element of the slice (zeroing).
    pub densify_ns_per_elem: f64,
    /// Server: densifying, ns per pair placed.
    pub densify_ns_per_pair: f64,
    /// Server: copying a dense slot out, ns per element.
    pub copy_ns_per_elem: f64,
}

impl Default for SparseCosts {
    /// 10 GbE and single-threaded costs of a 2020s server core (the runtime
    /// measures its own at start-up: `tidewire_gpu::cpu::calibrate_sparse`).
    fn default() -> Self {
        SparseCosts {
            link_bytes_per_s: 1.25e9,
            encode_ns_per_elem: 0.15,
            encode_ns_per_pair: 4.0,
            densify_ns_per_elem: 0.05,
            densify_ns_per_pair: 2.0,
            copy_ns_per_elem: 0.1,
        }
    }
}

impl SparseCosts {
    /// These costs on a link of `bytes_per_s`.
    pub fn with_link(mut self, bytes_per_s: f64) -> Self {
        self.link_bytes_per_s = bytes_per_s;
        self
    }

    /// Modelled ns to push a slice of `len` elements dense.
    pub fn dense_ns(&self, len: usize) -> f64 {
        len as f64 * (4e9 / self.link_bytes_per_s + self.copy_ns_per_elem)
    }

    /// Modelled ns to push a slice of `len` elements with `pairs` pairs sparse.
    pub fn sparse_ns(&self, len: usize, pairs: usize) -> f64 {
        len as f64 * (self.encode_ns_per_elem + self.densify_ns_per_elem)
            + pairs as f64 * (self.encode_ns_per_pair + self.densify_ns_per_pair)
            + encoded_bytes(pairs) as f64 * 1e9 / self.link_bytes_per_s
    }

    /// The most pairs with which the sparse form of a `len`-element slice is
    /// no slower than the dense one (`None`: never, even empty).
    pub fn max_pairs(&self, len: usize) -> Option<usize> {
        if encoded_bytes(0) >= len * 4 {
            // Even an empty encoding (its header) is no smaller than the dense
            // slice of 1 or 2 elements, and would not fit the slice's staging.
            return None;
        }
        let ns_per_byte = 1e9 / self.link_bytes_per_s;
        let spare_ns = self.dense_ns(len)
            - len as f64 * (self.encode_ns_per_elem + self.densify_ns_per_elem)
            - HEADER_BYTES as f64 * ns_per_byte;
        let per_pair = self.encode_ns_per_pair + self.densify_ns_per_pair + PAIR_BYTES as f64 * ns_per_byte;
        if !(spare_ns >= 0.0 && per_pair > 0.0) {
            return None;
        }
        let n = (spare_ns / per_pair).floor();
        let n = if n >= pair_limit(len) as f64 {
            pair_limit(len)
        } else {
            n as usize
        };
        // A server refuses more pairs than the limit: never ask for more.
        debug_assert!(n <= pair_limit(len));
        Some(n)
    }

    /// The density below which sparse pays for a `len`-element slice (0: never).
    pub fn threshold(&self, len: usize) -> f64 {
        let t = self.max_pairs(len).map_or(0.0, |n| n as f64 / len.max(1) as f64);
        debug_assert!((0.0..1.0).contains(&t), "a density under 1: {t}");
        t
    }
}

/// What a worker's encode job found: the completion's `data` of a
/// [`JobKind::EncodeSparse`](crate::node::JobKind::EncodeSparse), 12 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeReport {
    /// Pairs written (`None`: over the cap, send dense).
    pub pairs: Option<u32>,
    /// Elements scanned (the whole slice unless over the cap).
    pub scanned: u64,
}

impl EncodeReport {
    /// Its bytes: pairs u32 (u32::MAX: over the cap), scanned u64, LE.
    pub fn to_bytes(self) -> Vec<u8> {
        // u32::MAX says "over the cap": no count is that large.
        debug_assert_ne!(self.pairs, Some(u32::MAX));
        let mut b = self.pairs.unwrap_or(u32::MAX).to_le_bytes().to_vec();
        b.extend_from_slice(&self.scanned.to_le_bytes());
        debug_assert_eq!(b.len(), 12);
        b
    }
    /// Decodes [`to_bytes`](Self::to_bytes); `None` when malformed.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != 12 {
            return None;
        }
        let p = u32::from_le_bytes(b[..4].try_into().ok()?);
        let r = EncodeReport {
            pairs: (p != u32::MAX).then_some(p),
            scanned: u64::from_le_bytes(b[4..].try_into().ok()?),
        };
        debug_assert_eq!(r.to_bytes(), b, "to_bytes and from_bytes agree");
        Some(r)
    }
}

/// Per-slice memory of the automatic choice. See the module docs.
#[derive(Debug, Clone)]
pub struct SparsePolicy {
    /// Per slice: pushes left to send dense before the next try.
    skip: Vec<u8>,
}

/// The choice for one push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// Send the slice as it is.
    Dense,
    /// Encode it, and send it sparse unless it has more than `cap` pairs.
    Try { cap: usize },
}

impl SparsePolicy {
    /// Pushes between tries of a slice whose last try was over the cap.
    pub const REPROBE: u8 = 16;

    /// The policy for `book`'s slices.
    pub fn new(book: &Book) -> Self {
        Self::from_slices(book.slices().len())
    }

    /// The policy for `n` slices (numbered from 0).
    pub fn from_slices(n: usize) -> Self {
        SparsePolicy { skip: vec![0; n] }
    }

    /// The choice for `slice` (of `len` elements).
    pub fn choose(&mut self, costs: &SparseCosts, slice: u32, len: usize) -> Choice {
        let Some(cap) = costs.max_pairs(len) else {
            return Choice::Dense;
        };
        match self.skip.get_mut(slice as usize) {
            Some(s) if *s > 0 => {
                debug_assert!(*s < Self::REPROBE, "slice {slice} skips {s}");
                *s -= 1;
                Choice::Dense
            }
            _ => {
                debug_assert!(cap <= pair_limit(len));
                Choice::Try { cap }
            }
        }
    }

    /// The try of `slice` found `pairs` (`None`: over the cap).
    pub fn report(&mut self, slice: u32, pairs: Option<u32>) {
        if let Some(s) = self.skip.get_mut(slice as usize) {
            *s = if pairs.is_some() { 0 } else { Self::REPROBE - 1 };
        }
    }
}

/// Counters of one sparse layer's pushes (this worker's, to remote servers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SparseLayerStats {
    /// Slices sent as pairs.
    pub sparse_pushes: u64,
    /// Slices sent dense (over the cap, or not tried).
    pub dense_pushes: u64,
    /// Nonzero elements found by the tries that finished (sent as pairs).
    pub nonzeros: u64,
    /// Elements of the slices whose tries finished (density = nonzeros / scanned).
    pub scanned: u64,
    /// Bytes written as pairs (headers included).
    pub sparse_bytes: u64,
    /// Bytes written dense.
    pub dense_bytes: u64,
}

impl SparseLayerStats {
    /// Nonzeros over elements of the slices encoded (0 when none was).
    pub fn density(&self) -> f64 {
        // A try counts the nonzeros of the elements it scanned.
        debug_assert!(self.nonzeros <= self.scanned);
        if self.scanned == 0 {
            0.0
        } else {
            self.nonzeros as f64 / self.scanned as f64
        }
    }
    /// Adds another's counts.
    pub fn add(&mut self, o: &SparseLayerStats) {
        self.sparse_pushes += o.sparse_pushes;
        self.dense_pushes += o.dense_pushes;
        self.nonzeros += o.nonzeros;
        self.scanned += o.scanned;
        self.sparse_bytes += o.sparse_bytes;
        self.dense_bytes += o.dense_bytes;
        debug_assert!(self.nonzeros <= self.scanned, "{self:?}");
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_slice_no_larger_than_the_header_never_goes_sparse() {
        // Copies so dear that any encoding would win by time: the header alone
        // (8 bytes) is still no smaller than 1 or 2 elements, nor fits their staging.
        let c = SparseCosts {
            copy_ns_per_elem: 1e12,
            ..SparseCosts::default()
        };
        assert_eq!((c.max_pairs(1), c.max_pairs(2)), (None, None));
        assert_eq!(c.threshold(1), 0.0);
        assert!(c.max_pairs(3).is_some(), "from 3 elements an empty encoding is smaller");
    }
    use super::*;
    use crate::testkit::Rng;

    fn random_slice(rng: &mut Rng, len: usize, density: f64) -> Vec<f32> {
        (0..len)
            .map(|_| {
                if (rng.next_u64() % 1_000_000) as f64 / 1e6 < density {
                    match rng.next_u64() % 8 {
                        0 => -0.0,
                        1 => f32::from_bits(0x7fc0_0001),
                        2 => f32::from_bits(1),
                        _ => (rng.next_u64() % 2001) as f32 / 7.0 - 140.0,
                    }
                } else {
                    0.0
                }
            })
            .collect()
    }

    fn words(b: &[u8]) -> Vec<u32> {
        b.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn encode_then_densify_gives_back_the_bits() {
        let seed = crate::testkit::seed("TIDEWIRE_SPARSE_SEED");
        let mut rng = Rng(seed);
        for _ in 0..200 {
            let len = 1 + (rng.next_u64() % 5000) as usize;
            let density = [0.0, 0.001, 0.05, 0.3, 1.0][(rng.next_u64() % 5) as usize];
            let src = random_slice(&mut rng, len, density);
            let nnz = src.iter().filter(|v| is_pair(**v)).count();
            let mut enc = Vec::new();
            match encode(&src, usize::MAX, &mut enc) {
                Some(n) => {
                    assert_eq!(n, nnz, "seed {seed}");
                    assert_eq!(enc.len(), encoded_bytes(n));
                    let mut out = vec![1.0; len];
                    densify(&words(&enc), n, &mut out).expect("valid");
                    let a: Vec<u32> = src.iter().map(|v| v.to_bits()).collect();
                    let b: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(a, b, "seed {seed}");
                }
                None => assert!(nnz > pair_limit(len), "seed {seed}: {nnz} of {len}"),
            }
            // A cap below the count stops the encoding.
            if nnz > 0 {
                assert_eq!(encode(&src, nnz - 1, &mut enc), None, "seed {seed}");
            }
        }
    }

    #[test]
    fn hostile_encodings_are_errors() {
        let seed = crate::testkit::seed("TIDEWIRE_SPARSE_SEED");
        let mut rng = Rng(seed);
        for _ in 0..2000 {
            let len = 1 + (rng.next_u64() % 64) as usize;
            let pairs = (rng.next_u64() % 8) as usize;
            let n = (rng.next_u64() % 20) as usize;
            let w: Vec<u32> = (0..n)
                .map(|_| match rng.next_u64() % 3 {
                    0 => (rng.next_u64() % 70) as u32,
                    1 => pairs as u32,
                    _ => rng.next_u64() as u32,
                })
                .collect();
            let mut out = vec![0.0; len];
            if let Ok(()) = densify(&w, pairs, &mut out) {
                // Whatever passed is a valid encoding: sorted, in range.
                let idx: Vec<u32> = w[2..].chunks(2).map(|p| p[0]).collect();
                assert!(idx.windows(2).all(|x| x[0] < x[1]) && idx.iter().all(|&i| (i as usize) < len));
            }
        }
        let mut out = vec![0.0; 4];
        assert!(matches!(densify(&[1, 4, 2, 7], 1, &mut out), Ok(())));
        assert!(matches!(
            densify(&[1, 4, 4, 7], 1, &mut out),
            Err(SparseError::Index { .. })
        ));
        assert!(matches!(
            densify(&[2, 4, 1, 7, 1, 8], 2, &mut out),
            Err(SparseError::Index { .. })
        ));
        assert!(matches!(
            densify(&[1, 5, 1, 7], 1, &mut out),
            Err(SparseError::Header { .. })
        ));
        assert!(matches!(densify(&[1], 0, &mut out), Err(SparseError::Header { .. })));
    }

    #[test]
    fn the_threshold_falls_as_the_link_gets_faster() {
        let c = SparseCosts::default();
        let len = 50_000;
        let t1 = c.with_link(0.125e9).threshold(len);
        let t10 = c.with_link(1.25e9).threshold(len);
        let t40 = c.with_link(5e9).threshold(len);
        assert!(t1 > t10 && t10 > t40, "{t1} {t10} {t40}");
        assert!(t1 <= 0.5);
        // At the cap, sparse is no slower; one pair more, it is.
        let c10 = c.with_link(1.25e9);
        let cap = c10.max_pairs(len).expect("pays at 10 GbE");
        assert!(c10.sparse_ns(len, cap) <= c10.dense_ns(len));
        assert!(c10.sparse_ns(len, cap + 1) > c10.dense_ns(len) || cap == pair_limit(len));
        // A link so fast that scanning costs more than sending: never.
        assert_eq!(c.with_link(1e12).max_pairs(len), None);
    }

    #[test]
    fn the_policy_skips_after_an_over_cap_try_and_tries_again() {
        let book = Book::new(
            crate::Cluster::colocated(1).expect("one rank"),
            vec![crate::book::LayerSpec::new(
                "emb",
                crate::book::LayerKind::Other,
                10,
                100,
            )],
            crate::BookConfig::default(),
        )
        .expect("valid");
        let mut p = SparsePolicy::new(&book);
        let c = SparseCosts::default();
        assert!(matches!(p.choose(&c, 0, 1000), Choice::Try { .. }));
        p.report(0, None);
        for _ in 0..SparsePolicy::REPROBE - 1 {
            assert_eq!(p.choose(&c, 0, 1000), Choice::Dense);
        }
        assert!(matches!(p.choose(&c, 0, 1000), Choice::Try { .. }));
        p.report(0, Some(3));
        assert!(matches!(p.choose(&c, 0, 1000), Choice::Try { .. }));
    }

    #[test]
    fn reports_round_trip_and_reject_garbage() {
        for r in [
            EncodeReport {
                pairs: None,
                scanned: 7,
            },
            EncodeReport {
                pairs: Some(0),
                scanned: 0,
            },
            EncodeReport {
                pairs: Some(12),
                scanned: u64::MAX,
            },
        ] {
            assert_eq!(EncodeReport::from_bytes(&r.to_bytes()), Some(r));
        }
        assert_eq!(EncodeReport::from_bytes(&[0; 11]), None);
    }
}

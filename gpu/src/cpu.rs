//! The CPU path of aggregation, apply and sufficient-factor reconstruction,
//! shared by the driver and the single-process reference so that both
//! produce the same bits. Every function is elementwise or has a fixed evaluation order;
//! none reassociates a sum, so results do not depend on threads or vector width.

pub use tidewire_engine::ApplyOp;

/// `acc[i] += src[i]`.
pub fn add_assign(acc: &mut [f32], src: &[f32]) {
    assert_eq!(acc.len(), src.len(), "add_assign length mismatch");
    for (a, s) in acc.iter_mut().zip(src) {
        *a += *s;
    }
}

/// Elements a thread handles per step of [`sum_into`]: 16 KiB of the accumulator,
/// which stays in L1 while every input streams through it once.
const SUM_CHUNK: usize = 4096;

/// Checks every input's length against the accumulator's, then runs
/// `f(at, chunk)` over [`SUM_CHUNK`]-element chunks of `acc` (`at` is the
/// chunk's first index), split into contiguous blocks over `threads` threads.
fn for_chunks<T>(what: &str, acc: &mut [f32], inputs: &[&[T]], threads: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    for (i, x) in inputs.iter().enumerate() {
        assert_eq!(
            x.len(),
            acc.len(),
            "{what}: input {i} has {} elements, the accumulator {}",
            x.len(),
            acc.len()
        );
    }
    let n = acc.len();
    let threads = threads.clamp(1, n.div_ceil(SUM_CHUNK).max(1));
    let block = n.div_ceil(threads).div_ceil(SUM_CHUNK) * SUM_CHUNK;
    let f = &f;
    std::thread::scope(|s| {
        for (t, part) in acc.chunks_mut(block.max(1)).enumerate() {
            let base = t * block;
            s.spawn(move || {
                for (c, chunk) in part.chunks_mut(SUM_CHUNK).enumerate() {
                    f(base + c * SUM_CHUNK, chunk);
                }
            });
        }
    });
}

/// `acc[i] += inputs[0][i] + inputs[1][i] + ...`, added in input order for every
/// element, on `threads` threads (contiguous blocks; 0 means 1).
///
/// Each element is summed in the same order whatever the thread count, so the
/// result is bitwise equal to repeated [`add_assign`]. Per thread, a 16 KiB
/// block of the accumulator stays in cache while every input passes over it
/// once: memory sees P reads of the inputs, one read and one write of `acc`.
/// The inner loop is a plain zip that the compiler vectorizes.
///
/// # Panics
/// If an input's length differs from the accumulator's.
pub fn sum_into(acc: &mut [f32], inputs: &[&[f32]], threads: usize) {
    for_chunks("sum_into", acc, inputs, threads, |at, chunk| {
        let len = chunk.len();
        // Four inputs per pass keep the running sum in registers; the
        // additions still happen in input order for every element.
        let mut groups = inputs.chunks_exact(4);
        for g in groups.by_ref() {
            let (x0, x1, x2, x3) = (
                &g[0][at..at + len],
                &g[1][at..at + len],
                &g[2][at..at + len],
                &g[3][at..at + len],
            );
            for i in 0..len {
                chunk[i] = (((chunk[i] + x0[i]) + x1[i]) + x2[i]) + x3[i];
            }
        }
        for x in groups.remainder() {
            for (a, v) in chunk.iter_mut().zip(&x[at..at + len]) {
                *a += *v;
            }
        }
    });
}

/// An input element type for aggregation: f32, or a 16-bit float that is
/// widened to f32 (exactly) before it is added.
pub trait Element: Copy + Send + Sync + 'static {
    /// The kernel's name for the type.
    const NAME: &'static str;
    /// The exact f32 value.
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Element for half::bf16 {
    const NAME: &'static str = "bf16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

impl Element for half::f16 {
    const NAME: &'static str = "f16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

/// [`sum_into`] for any [`Element`]: `acc[i] += f32(inputs[0][i]) + f32(inputs[1][i]) + ...`,
/// accumulated in f32 in input order, on `threads` threads. bf16 and f16
/// widen exactly, so the result is bitwise what the GPU's deterministic
/// kernel produces.
///
/// # Panics
/// If an input's length differs from the accumulator's.
pub fn sum_into_as<T: Element>(acc: &mut [f32], inputs: &[&[T]], threads: usize) {
    for_chunks("sum_into_as", acc, inputs, threads, |at, chunk| {
        let len = chunk.len();
        for x in inputs {
            for (a, v) in chunk.iter_mut().zip(&x[at..at + len]) {
                *a += v.to_f32();
            }
        }
    });
}

/// `x[i] *= s`.
pub fn scale(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}

/// STREAM's triad, `a[i] = b[i] + s * c[i]`, on `threads` threads: the memory
/// bandwidth that [`sum_into`] is judged against.
///
/// # Panics
/// If the lengths differ.
pub fn triad(a: &mut [f32], b: &[f32], c: &[f32], s: f32, threads: usize) {
    assert!(a.len() == b.len() && a.len() == c.len(), "triad: lengths differ");
    let n = a.len();
    let threads = threads.clamp(1, n.max(1));
    let block = n.div_ceil(threads).max(1);
    std::thread::scope(|sc| {
        for (t, part) in a.chunks_mut(block).enumerate() {
            let at = t * block;
            let (b, c) = (&b[at..at + part.len()], &c[at..at + part.len()]);
            sc.spawn(move || {
                for ((a, b), c) in part.iter_mut().zip(b).zip(c) {
                    *a = *b + s * *c;
                }
            });
        }
    });
}

/// Applies `op` to `params` from `acc`, the sum of `p1` contributions.
/// `momentum` must have `params.len()` elements when the op needs it.
pub fn apply(op: ApplyOp, p1: usize, acc: &[f32], params: &mut [f32], momentum: &mut [f32]) {
    assert_eq!(acc.len(), params.len(), "apply length mismatch");
    let inv = 1.0f32 / p1 as f32;
    match op {
        ApplyOp::Sum => params.copy_from_slice(acc),
        ApplyOp::Mean => {
            for (w, a) in params.iter_mut().zip(acc) {
                *w = *a * inv;
            }
        }
        ApplyOp::Sgd {
            lr,
            momentum: mu,
            weight_decay: wd,
        } => {
            if mu == 0.0 {
                for (w, a) in params.iter_mut().zip(acc) {
                    *w -= lr * (*a * inv + wd * *w);
                }
            } else {
                assert_eq!(momentum.len(), params.len(), "momentum length mismatch");
                for ((w, a), v) in params.iter_mut().zip(acc).zip(momentum.iter_mut()) {
                    *v = mu * *v + lr * (*a * inv + wd * *w);
                    *w -= *v;
                }
            }
        }
    }
}

/// Rows `sf_rows` starts at: `r0` must be a multiple of it.
pub const SF_ROW_BLOCK: usize = 64;

/// Bytes of V one GEMM call packs, and (from K = 64; twice that at K = 32,
/// the block's 64 rows being the least) of the output block it writes:
/// about an L2's share, so the packed panel of V serves many rows and the
/// block is still in the cache when [`sf_sum`] adds the next worker's.
/// (With 64 rows of every column a call, V was packed again every 64 rows:
/// on the 2-core VM K = 256 × N = 9216 ran at 63 to 68 GFLOP/s where 256
/// rows a call gave 87 to 95, and 256 rows of all 25088 columns at K = 32
/// fell from 44 to 30-35, the block no longer in the cache.)
const SF_TILE_BYTES: usize = 1 << 20;

/// The tile `sf_rows` and `sf_sum` cut U^T·V into, for K and N: (rows,
/// columns), rows a multiple of [`SF_ROW_BLOCK`]. A function of the shape
/// alone; the bits of an element do not depend on it anyway (each is one
/// dot product over K in the GEMM's own order: the tests compare tiles
/// with one whole-matrix call).
fn sf_tile(k: usize, n: usize) -> (usize, usize) {
    let cols = (SF_TILE_BYTES / 4 / k.max(1)).max(256).min(n.max(1));
    let rows = (SF_TILE_BYTES / 4 / cols).clamp(SF_ROW_BLOCK, 1024) / SF_ROW_BLOCK * SF_ROW_BLOCK;
    (rows, cols)
}

/// Rows `[r0, r0 + out.len()/n)` of Uᵀ·V, where U is K×M and V is K×N (row
/// major): the gradient of an M×N FC weight from its sufficient factors.
/// `r0` must be a multiple of [`SF_ROW_BLOCK`].
pub fn sf_rows(u: &[f32], v: &[f32], k: usize, m: usize, n: usize, r0: usize, out: &mut [f32]) {
    assert_eq!(u.len(), k * m, "U must be K×M");
    assert_eq!(v.len(), k * n, "V must be K×N");
    assert_eq!(out.len() % n.max(1), 0, "out must hold whole rows");
    assert_eq!(r0 % SF_ROW_BLOCK, 0, "row start must be block aligned");
    let rows = out.len() / n.max(1);
    assert!(r0 + rows <= m, "rows out of range");
    if k == 0 {
        // No samples: a zero gradient (U and V are empty).
        out.fill(0.0);
        return;
    }
    let (tr, tc) = sf_tile(k, n);
    let mut r = 0;
    while r < rows {
        let b = tr.min(rows - r);
        let mut c0 = 0;
        while c0 < n {
            let w = tc.min(n - c0);
            sgemm_tile(&u[r0 + r..], &v[c0..], (b, k, w), (m, n), &mut out[r * n + c0..], n);
            c0 += w;
        }
        r += b;
    }
}

/// C (b×w, rows `ldc` apart) = A·B, where A = Uᵀ's rows from the start of
/// `a` (element (i, kk) at `a[kk*lda + i]`) and B = V's columns from the
/// start of `b` (element (kk, j) at `b[kk*ldb + j]`). matrixmultiply takes
/// raw pointers with strides; it is the one GEMM crate with no threads, so
/// the result is reproducible.
fn sgemm_tile(
    a: &[f32],
    b: &[f32],
    (rows, k, w): (usize, usize, usize),
    (lda, ldb): (usize, usize),
    c: &mut [f32],
    ldc: usize,
) {
    matrixmultiply_sgemm(rows, k, w, a, 1, lda as isize, b, ldb as isize, 1, c, ldc as isize, 1);
}

#[allow(clippy::too_many_arguments)]
fn matrixmultiply_sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    rsa: isize,
    csa: isize,
    b: &[f32],
    rsb: isize,
    csb: isize,
    c: &mut [f32],
    rsc: isize,
    csc: isize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // An empty sum: zero the m×n block, and nothing else of `c`.
        for i in 0..m {
            for j in 0..n {
                c[i * rsc as usize + j * csc as usize] = 0.0;
            }
        }
        return;
    }
    // Every index the product touches must lie inside the slices.
    assert!(((m - 1) as isize * rsa + (k - 1) as isize * csa) < a.len() as isize);
    assert!(((k - 1) as isize * rsb + (n - 1) as isize * csb) < b.len() as isize);
    assert!(((m - 1) as isize * rsc + (n - 1) as isize * csc) < c.len() as isize);
    // (With beta = 0 the GEMM writes `c` first; it reads it back and adds to
    // it only where K spans more than one of its K blocks.)
    // SAFETY: the asserts above keep every access inside `a`, `b` and `c`
    // (positive strides); `c` is a unique borrow of initialized floats.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            0.0,
            c.as_mut_ptr(),
            rsc,
            csc,
        )
    }
}

/// Σ_p U_pᵀV_p in rank order into `out` (M×N), one tile at a time (the
/// later workers' products in a scratch tile added while both are in the
/// cache). Produces the same bits as computing each U_pᵀV_p with
/// [`sf_rows`] and summing them with [`add_assign`] in the same order,
/// which is what a parameter server does.
pub fn sf_sum(factors: &[(&[f32], &[f32])], k: usize, m: usize, n: usize, out: &mut [f32]) {
    assert_eq!(out.len(), m * n, "out must be M×N");
    for (u, v) in factors {
        assert_eq!(u.len(), k * m, "U must be K×M");
        assert_eq!(v.len(), k * n, "V must be K×N");
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }
    let (tr, tc) = sf_tile(k, n);
    let mut scratch = vec![0f32; tr * tc];
    let mut r0 = 0;
    while r0 < m {
        let b = tr.min(m - r0);
        let mut c0 = 0;
        while c0 < n {
            let w = tc.min(n - c0);
            for (p, (u, v)) in factors.iter().enumerate() {
                let dst = &mut out[r0 * n + c0..];
                if p == 0 {
                    sgemm_tile(&u[r0..], &v[c0..], (b, k, w), (m, n), dst, n);
                } else {
                    let s = &mut scratch[..b * w];
                    sgemm_tile(&u[r0..], &v[c0..], (b, k, w), (m, n), s, w);
                    for (i, row) in s.chunks_exact(w).enumerate() {
                        add_assign(&mut dst[i * n..i * n + w], row);
                    }
                }
            }
            c0 += w;
        }
        r0 += b;
    }
}

/// Slices shorter than this are encoded and densified on one thread.
/// `tidewire-sparse` measures encode and densify on 1 to 8 threads from 50k to
/// 4M elements (`bench/results/sparse-push.md`): on the 2-core development VM
/// (shared with other builds) a second thread made both slower at every size
/// up to 4M, so threads start only above that; the default 50,000-element
/// slices never use them. Re-run it on a quiet many-core server to lower it.
pub const SPARSE_PAR_MIN: usize = 1 << 22;

/// The threads [`sparse_encode`] and [`sparse_densify`] use for a slice of
/// `len` elements given `threads`: one below [`SPARSE_PAR_MIN`], else up to
/// `threads` with at least a quarter of it each.
pub fn sparse_threads(len: usize, threads: usize) -> usize {
    if len < SPARSE_PAR_MIN {
        1
    } else {
        threads.clamp(1, len / (SPARSE_PAR_MIN / 4))
    }
}

/// Encodes `src` as index/value pairs into `out` (header, then pairs; the
/// layout of [`tidewire_engine::sparse`]) unless it has more than `cap`
/// nonzeros (then `None`, and `out` holds garbage). `Some(pairs)` otherwise.
/// On `threads` threads (contiguous parts, concatenated in order) from
/// [`SPARSE_PAR_MIN`] elements; the bytes are the single-threaded
/// reference's ([`tidewire_engine::sparse::encode`]) whatever the count.
///
/// # Panics
/// If `out` is shorter than the encoding of `min(cap, pair_limit)` pairs.
pub fn sparse_encode(src: &[f32], cap: usize, out: &mut [u8], threads: usize) -> Option<usize> {
    sparse_encode_on(src, cap, out, sparse_threads(src.len(), threads))
}

/// [`sparse_encode`] on exactly `threads` threads (at least 1), whatever the
/// size: for measuring where threads start to pay.
pub fn sparse_encode_on(src: &[f32], cap: usize, out: &mut [u8], threads: usize) -> Option<usize> {
    use tidewire_engine::sparse::{encode_into, encoded_bytes, header, pair_limit};
    let cap = cap.min(pair_limit(src.len()));
    assert!(
        out.len() >= encoded_bytes(cap),
        "sparse_encode: {} bytes for {cap} pairs",
        out.len()
    );
    let t = threads.clamp(1, src.len().max(1));
    let part = src.len().div_ceil(t).max(1);
    let mut words: Vec<Vec<u32>> = Vec::new();
    if t == 1 {
        let mut w = Vec::new();
        if !encode_into(src, 0, cap, &mut w) {
            return None;
        }
        words.push(w);
    } else {
        let parts: Vec<Option<Vec<u32>>> = std::thread::scope(|s| {
            let hs: Vec<_> = src
                .chunks(part)
                .enumerate()
                .map(|(i, c)| {
                    s.spawn(move || {
                        let mut w = Vec::new();
                        encode_into(c, (i * part) as u32, cap, &mut w).then_some(w)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("encoder thread")).collect()
        });
        for p in parts {
            words.push(p?);
        }
    }
    let n: usize = words.iter().map(|w| w.len() / 2).sum();
    if n > cap {
        return None;
    }
    out[..8].copy_from_slice(&header(n, src.len()));
    let mut at = 8;
    for w in words.iter().flatten() {
        out[at..at + 4].copy_from_slice(&w.to_le_bytes());
        at += 4;
    }
    Some(n)
}

/// Turns an encoded slice (`words`: header then `pairs` pairs, as u32 words)
/// back into its `out.len()` elements, bitwise what was encoded; a malformed
/// encoding is an error, never a panic. On `threads` threads from
/// [`SPARSE_PAR_MIN`] elements (each zeroes its part of `out` and places the
/// pairs that fall in it); the same bits as [`tidewire_engine::sparse::densify`].
pub fn sparse_densify(
    words: &[u32],
    pairs: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<(), tidewire_engine::sparse::SparseError> {
    let t = sparse_threads(out.len(), threads);
    sparse_densify_on(words, pairs, out, t)
}

/// [`sparse_densify`] on exactly `threads` threads (at least 1), whatever the size.
pub fn sparse_densify_on(
    words: &[u32],
    pairs: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<(), tidewire_engine::sparse::SparseError> {
    use tidewire_engine::sparse::{check_header, scatter_range};
    check_header(words, pairs, out.len())?;
    let len = out.len();
    let body = &words[2..];
    let t = threads.clamp(1, len.max(1));
    if t == 1 {
        out.fill(0.0);
        return scatter_range(body, 0, None, 0, len, out);
    }
    let part = len.div_ceil(t);
    let t = len.div_ceil(part);
    // Pair k of the body is words 2k (index) and 2k + 1 (value).
    let idx = |k: usize| body[2 * k];
    let split = |lo: usize| {
        let (mut a, mut b) = (0, pairs);
        while a < b {
            let m = (a + b) / 2;
            if (idx(m) as usize) < lo {
                a = m + 1;
            } else {
                b = m;
            }
        }
        a
    };
    let bounds: Vec<usize> = (0..=t).map(|i| if i == t { pairs } else { split(i * part) }).collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = out
            .chunks_mut(part)
            .enumerate()
            .map(|(i, o)| {
                let (a, b) = (bounds[i], bounds[i + 1].max(bounds[i]));
                let prev = a.checked_sub(1).map(idx);
                let mine = &body[2 * a..2 * b];
                s.spawn(move || {
                    o.fill(0.0);
                    scatter_range(mine, a, prev, i * part, len, o)
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| h.join().expect("densify thread"))
    })
    // The parts' pair ranges cover every pair without gaps (each starts where
    // the one before it ended, or earlier when the indices are not sorted, and
    // then a pair outside its part's range is an error).
}

/// Measures this machine's costs of the two forms of a push of a
/// `len`-element slice, on `threads` threads as the runtime runs them: the
/// measurement that sets the sparse threshold
/// ([`tidewire_engine::sparse::SparseCosts`], which documents the model).
/// An empty slice gives the per-element costs of encode (the scan) and
/// densify (the zeroing); one with 10% of its elements nonzero, in runs of 16
/// as an embedding's rows are, the per-pair costs; a dense slot's copy the
/// dense path's. Medians of five runs; a few milliseconds in all.
pub fn calibrate_sparse(len: usize, threads: usize, link_bytes_per_s: f64) -> tidewire_engine::sparse::SparseCosts {
    use std::time::Instant;
    let len = len.clamp(1024, 1 << 22);
    let median = |f: &mut dyn FnMut()| {
        let mut t: Vec<f64> = (0..5)
            .map(|_| {
                let s = Instant::now();
                f();
                s.elapsed().as_nanos() as f64
            })
            .collect();
        t.sort_by(f64::total_cmp);
        t[2]
    };
    let mut enc = vec![0u8; len * 4];
    let mut out = vec![0f32; len];
    // (encode ns, densify ns, pairs) of one slice.
    let mut measure = |src: &[f32]| {
        let e = median(&mut || {
            std::hint::black_box(sparse_encode(src, usize::MAX, &mut enc, threads));
        });
        let n = sparse_encode(src, usize::MAX, &mut enc, threads).unwrap_or(0);
        let words: Vec<u32> = enc[..tidewire_engine::sparse::encoded_bytes(n)]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let d = median(&mut || {
            let _ = std::hint::black_box(sparse_densify(&words, n, &mut out, threads));
        });
        (e, d, n)
    };
    let empty = vec![0f32; len];
    let runs: Vec<f32> = (0..len)
        .map(|i| if (i / 64) % 10 == 3 { 1.0 + i as f32 } else { 0.0 })
        .collect();
    let (e0, d0, _) = measure(&empty);
    let (e1, d1, n1) = measure(&runs);
    let mut dst = vec![0f32; len];
    let copy = median(&mut || {
        dst.copy_from_slice(std::hint::black_box(&runs));
        std::hint::black_box(&mut dst);
    });
    let per_pair = |a: f64, b: f64| ((b - a) / n1.max(1) as f64).max(0.0);
    tidewire_engine::sparse::SparseCosts {
        link_bytes_per_s,
        encode_ns_per_elem: e0 / len as f64,
        encode_ns_per_pair: per_pair(e0, e1),
        densify_ns_per_elem: d0 / len as f64,
        densify_ns_per_pair: per_pair(d0, d1),
        copy_ns_per_elem: copy / len as f64,
    }
}

/// The element type of a caller's memory: what a framework's tensors hold.
/// Values are widened to f32 for the wire and the servers' sums, and narrowed
/// back into the caller's type (round to nearest even) when results land.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostType {
    /// 32-bit float (no conversion).
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 64-bit float: carried and summed as f32, so values keep f32's 24-bit precision.
    F64,
}

impl HostType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            HostType::F32 => 4,
            HostType::F16 | HostType::Bf16 => 2,
            HostType::F64 => 8,
        }
    }
    /// Name for messages (`f32`, `f16`, `bf16`, `f64`).
    pub fn name(self) -> &'static str {
        match self {
            HostType::F32 => "f32",
            HostType::F16 => "f16",
            HostType::Bf16 => "bf16",
            HostType::F64 => "f64",
        }
    }
}

/// Widens `dst.len()` little-endian values of type `t` from `src` into f32.
/// Panics if `src` is not exactly `dst.len()` elements long.
pub fn widen(t: HostType, src: &[u8], dst: &mut [f32]) {
    assert_eq!(
        src.len(),
        dst.len() * t.size(),
        "widen: {} bytes for {} {}",
        src.len(),
        dst.len(),
        t.name()
    );
    match t {
        HostType::F32 => dst
            .iter_mut()
            .zip(src.chunks_exact(4))
            .for_each(|(d, c)| *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        HostType::F16 => dst
            .iter_mut()
            .zip(src.chunks_exact(2))
            .for_each(|(d, c)| *d = half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
        HostType::Bf16 => dst
            .iter_mut()
            .zip(src.chunks_exact(2))
            .for_each(|(d, c)| *d = half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        HostType::F64 => dst.iter_mut().zip(src.chunks_exact(8)).for_each(|(d, c)| {
            *d = f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32;
        }),
    }
}

/// Narrows f32 values into `dst` as little-endian values of type `t`.
/// Panics if `dst` is not exactly `src.len()` elements long.
pub fn narrow(t: HostType, src: &[f32], dst: &mut [u8]) {
    assert_eq!(
        dst.len(),
        src.len() * t.size(),
        "narrow: {} bytes for {} {}",
        dst.len(),
        src.len(),
        t.name()
    );
    match t {
        HostType::F32 => dst
            .chunks_exact_mut(4)
            .zip(src)
            .for_each(|(d, s)| d.copy_from_slice(&s.to_le_bytes())),
        HostType::F16 => dst
            .chunks_exact_mut(2)
            .zip(src)
            .for_each(|(d, s)| d.copy_from_slice(&half::f16::from_f32(*s).to_le_bytes())),
        HostType::Bf16 => dst
            .chunks_exact_mut(2)
            .zip(src)
            .for_each(|(d, s)| d.copy_from_slice(&half::bf16::from_f32(*s).to_le_bytes())),
        HostType::F64 => dst
            .chunks_exact_mut(8)
            .zip(src)
            .for_each(|(d, s)| d.copy_from_slice(&f64::from(*s).to_le_bytes())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threaded_sparse_kernels_match_the_reference_bitwise() {
        let seed = tidewire_engine::testkit::seed("TIDEWIRE_SPARSE_SEED");
        let mut st = seed;
        let mut next = || tidewire_engine::testkit::next(&mut st);
        for case in 0..12 {
            let len = if case % 3 == 0 {
                SPARSE_PAR_MIN * 2 + (next() % 999) as usize
            } else {
                1 + (next() % 9000) as usize
            };
            let density = [0.0, 1e-4, 0.01, 0.2, 0.6][case % 5];
            let src: Vec<f32> = (0..len)
                .map(|_| {
                    let x = next();
                    if ((x >> 11) as f64 / (1u64 << 53) as f64) < density {
                        [-0.0, 1.5, -2.25, f32::from_bits(0x7fc0_0003)][(x % 4) as usize]
                    } else {
                        0.0
                    }
                })
                .collect();
            let mut want = Vec::new();
            let r = tidewire_engine::sparse::encode(&src, usize::MAX, &mut want);
            for threads in [1, 2, 5] {
                let mut out = vec![0u8; len * 4];
                let got = if case % 2 == 0 {
                    sparse_encode(&src, usize::MAX, &mut out, threads)
                } else {
                    sparse_encode_on(&src, usize::MAX, &mut out, threads)
                };
                assert_eq!(got, r, "seed {seed} case {case} threads {threads}");
                let Some(n) = got else { continue };
                assert_eq!(
                    &out[..want.len()],
                    &want[..],
                    "seed {seed} case {case} threads {threads}"
                );
                let words: Vec<u32> = want
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let mut dense = vec![7.0f32; len];
                sparse_densify(&words, n, &mut dense, threads).expect("valid");
                assert!(
                    dense.iter().zip(&src).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "seed {seed} case {case}"
                );
                dense.fill(3.0);
                sparse_densify_on(&words, n, &mut dense, threads).expect("valid");
                assert!(
                    dense.iter().zip(&src).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "seed {seed} case {case}"
                );
                if n >= 2 {
                    // Two pairs swapped: an error on any thread count, never a panic.
                    let mut bad = words.clone();
                    bad.swap(2, 2 * n);
                    bad.swap(3, 2 * n + 1);
                    assert!(
                        sparse_densify(&bad, n, &mut dense, threads).is_err(),
                        "seed {seed} case {case}"
                    );
                    assert!(
                        sparse_densify_on(&bad, n, &mut dense, threads).is_err(),
                        "seed {seed} case {case}"
                    );
                }
                if n > 0 {
                    assert_eq!(
                        sparse_encode(&src, n - 1, &mut out, threads),
                        None,
                        "seed {seed} case {case}"
                    );
                }
            }
        }
    }

    #[test]
    fn host_types_round_trip_exactly_where_the_type_can() {
        // Every f16 and bf16 bit pattern (NaNs aside) widens and narrows back to itself.
        for bits in 0..=u16::MAX {
            for t in [HostType::F16, HostType::Bf16] {
                let mut w = [0f32];
                widen(t, &bits.to_le_bytes(), &mut w);
                if w[0].is_nan() {
                    continue;
                }
                let mut back = [0u8; 2];
                narrow(t, &w, &mut back);
                assert_eq!(u16::from_le_bytes(back), bits, "{t:?} {bits:#06x}");
            }
        }
        // f64 values that f32 holds exactly come back exactly; others round to nearest.
        let vals = [0.0f64, -1.5, 8589934592.0, f64::from(f32::MAX), 0.1];
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut w = vec![0f32; vals.len()];
        widen(HostType::F64, &bytes, &mut w);
        assert_eq!(w, vec![0.0, -1.5, 8589934592.0, f32::MAX, 0.1f32]);
        let mut back = vec![0u8; bytes.len()];
        narrow(HostType::F64, &w, &mut back);
        assert_eq!(&back[..32], &bytes[..32]);
        assert_eq!(f64::from_le_bytes(back[32..].try_into().unwrap()), f64::from(0.1f32));
        // f32 is a plain copy.
        let mut b = [0u8; 8];
        narrow(HostType::F32, &[1.0, -2.0], &mut b);
        let mut w = [0f32; 2];
        widen(HostType::F32, &b, &mut w);
        assert_eq!(w, [1.0, -2.0]);
    }

    #[test]
    fn sum_into_is_bitwise_repeated_add_for_any_thread_count() {
        // Odd sizes: blocks and chunks end mid-way; values whose sums round differently by order.
        for n in [1usize, 7, 4095, 4097, 3 * 4096 + 5, 50_001] {
            let inputs: Vec<Vec<f32>> = (0..5)
                .map(|p| {
                    (0..n)
                        .map(|i| ((i * 31 + p * 7) % 97) as f32 * 1e-3 + (p as f32) * 1e4)
                        .collect()
                })
                .collect();
            let refs: Vec<&[f32]> = inputs.iter().map(|v| v.as_slice()).collect();
            let mut want: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
            let start = want.clone();
            for x in &refs {
                add_assign(&mut want, x);
            }
            for threads in [0, 1, 2, 3, 8] {
                let mut got = start.clone();
                sum_into(&mut got, &refs, threads);
                assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "n={n} threads={threads}"
                );
            }
        }
        let mut empty: Vec<f32> = Vec::new();
        sum_into(&mut empty, &[&[]], 4);
    }

    #[test]
    #[should_panic(expected = "input 1 has 3 elements")]
    fn sum_into_refuses_mismatched_lengths() {
        sum_into(&mut [0.0; 4], &[&[1.0; 4], &[1.0; 3]], 2);
    }

    #[test]
    fn triad_matches_the_formula() {
        let n = 10_007;
        let b: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let c: Vec<f32> = (0..n).map(|i| (n - i) as f32).collect();
        for threads in [1, 2, 5] {
            let mut a = vec![0.0; n];
            triad(&mut a, &b, &c, 3.0, threads);
            assert!(a.iter().enumerate().all(|(i, &x)| x == b[i] + 3.0 * c[i]));
        }
    }

    fn naive(u: &[f32], v: &[f32], k: usize, m: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|kk| u[kk * m + i] as f64 * v[kk * n + j] as f64).sum();
            }
        }
        out
    }

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn sf_rows_is_u_transpose_v() {
        let (k, m, n) = (5, 130, 7);
        let (u, v) = (data(k * m, 1), data(k * n, 2));
        let mut out = vec![0f32; m * n];
        sf_rows(&u, &v, k, m, n, 0, &mut out);
        for (a, b) in out.iter().zip(naive(&u, &v, k, m, n)) {
            assert!((*a as f64 - b).abs() < 1e-4, "{a} vs {b}");
        }
    }

    /// U^T·V in one GEMM call over the whole matrix.
    fn whole(u: &[f32], v: &[f32], k: usize, m: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0f32; m * n];
        matrixmultiply_sgemm(m, k, n, u, 1, m as isize, v, n as isize, 1, &mut c, n as isize, 1);
        c
    }

    #[test]
    fn tiles_give_the_bits_of_one_whole_matrix_call() {
        // Shapes whose tiles are partial in rows and columns, K below, at
        // and above the GEMM's K blocking (256), and a row start past 0.
        for (k, m, n) in [
            (3, 150, 9),
            (32, 700, 1100),
            (256, 130, 300),
            (300, 70, 1030),
            (1, 130, 5000),
            (0, 70, 9),
        ] {
            let (u, v) = (data(k * m, k as u32), data(k * n, n as u32));
            let want = whole(&u, &v, k, m, n);
            let mut got = vec![0f32; m * n];
            sf_rows(&u, &v, k, m, n, 0, &mut got);
            assert!(
                got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{k}×{m}×{n}"
            );
            let r0 = SF_ROW_BLOCK;
            let mut part = vec![0f32; (m - r0) * n];
            sf_rows(&u, &v, k, m, n, r0, &mut part);
            assert!(part
                .iter()
                .zip(&want[r0 * n..])
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn sf_sum_matches_ps_order_bitwise() {
        // The last two cut N into several column tiles (the scratch tile narrower than a row).
        for (k, m, n) in [(3, 150, 9), (32, 300, 1500), (300, 70, 1030), (256, 130, 2000)] {
            let fs: Vec<(Vec<f32>, Vec<f32>)> = (0..4).map(|p| (data(k * m, p), data(k * n, p + 10))).collect();
            let refs: Vec<(&[f32], &[f32])> = fs.iter().map(|(u, v)| (u.as_slice(), v.as_slice())).collect();
            let mut sfb = vec![0f32; m * n];
            sf_sum(&refs, k, m, n, &mut sfb);
            // The PS way: each worker's full gradient, summed in rank order.
            let mut acc = vec![0f32; m * n];
            for (p, (u, v)) in refs.iter().enumerate() {
                let mut g = vec![0f32; m * n];
                sf_rows(u, v, k, m, n, 0, &mut g);
                if p == 0 {
                    acc = g;
                } else {
                    add_assign(&mut acc, &g);
                }
            }
            assert!(sfb.iter().zip(&acc).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn apply_ops() {
        let acc = [2.0f32, 4.0];
        let mut w = [1.0f32, 1.0];
        apply(ApplyOp::Mean, 2, &acc, &mut w, &mut []);
        assert_eq!(w, [1.0, 2.0]);
        apply(ApplyOp::Sum, 2, &acc, &mut w, &mut []);
        assert_eq!(w, [2.0, 4.0]);
        let mut w = [1.0f32, 1.0];
        let mut v = [0.0f32, 0.0];
        let op = ApplyOp::Sgd {
            lr: 0.5,
            momentum: 0.9,
            weight_decay: 0.0,
        };
        apply(op, 2, &acc, &mut w, &mut v);
        assert_eq!(v, [0.5, 1.0]);
        assert_eq!(w, [0.5, 0.0]);
        apply(op, 2, &acc, &mut w, &mut v);
        assert_eq!(v, [0.95, 1.9]);
    }

    #[test]
    fn sum_into_as_widens_exactly_and_keeps_order() {
        let n = 3 * SUM_CHUNK + 5;
        let f: Vec<Vec<f32>> = (0..5).map(|p| data(n, 40 + p)).collect();
        let bf: Vec<Vec<half::bf16>> = f
            .iter()
            .map(|v| v.iter().map(|x| half::bf16::from_f32(*x)).collect())
            .collect();
        let hf: Vec<Vec<half::f16>> = f
            .iter()
            .map(|v| v.iter().map(|x| half::f16::from_f32(*x)).collect())
            .collect();
        let base = data(n, 7);
        // f32 through the generic path equals the tuned one, bitwise.
        let mut a = base.clone();
        sum_into(&mut a, &f.iter().map(|v| &v[..]).collect::<Vec<_>>(), 3);
        let mut b = base.clone();
        sum_into_as(&mut b, &f.iter().map(|v| &v[..]).collect::<Vec<_>>(), 2);
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        // bf16/f16: each element is acc + widen(x0) + widen(x1) ... in order.
        for threads in [1, 4] {
            let mut c = base.clone();
            sum_into_as(&mut c, &bf.iter().map(|v| &v[..]).collect::<Vec<_>>(), threads);
            let mut d = base.clone();
            sum_into_as(&mut d, &hf.iter().map(|v| &v[..]).collect::<Vec<_>>(), threads);
            for i in [0, 1, SUM_CHUNK, n - 1] {
                let want_b = bf.iter().fold(base[i], |a, v| a + v[i].to_f32());
                let want_h = hf.iter().fold(base[i], |a, v| a + v[i].to_f32());
                assert_eq!(c[i].to_bits(), want_b.to_bits(), "bf16 at {i}");
                assert_eq!(d[i].to_bits(), want_h.to_bits(), "f16 at {i}");
                // The 16-bit inputs are close to the f32 ones, not equal.
                assert!((c[i] - a[i]).abs() <= 0.05 * (1.0 + a[i].abs()), "{} vs {}", c[i], a[i]);
            }
        }
        let mut x = vec![1.5f32, -2.0];
        scale(&mut x, 0.5);
        assert_eq!(x, [0.75, -1.0]);
    }
}

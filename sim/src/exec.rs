//! A rank's memory and the jobs run on it. Every job a Node emits is executed
//! here with the kernels the runtime ships ([`tidewire_gpu::cpu`]): the
//! servers' sums and fold, the apply ops, the reconstruction of gradients
//! from sufficient factors, the sparse codec. The checker ([`crate::check`])
//! holds an independent oracle (exact sums in f64), so a broken kernel fails
//! the VOPR. [`job_ns`] is each job's modelled time.

use tidewire_engine::book::Book;
use tidewire_engine::fxhash::{FxHashMap as HashMap, FxHashSet as HashSet};
use tidewire_engine::node::{Blob, Job, JobKind, Loc, LocalRegion, Node};
use tidewire_engine::sparse::{self, EncodeReport};
use tidewire_gpu::cpu;

use crate::config::SimConfig;

/// Jobs run on one thread: the simulator is single-threaded and its runs
/// are pure functions of their seed (the kernels' results do not depend on
/// the thread count anyway).
const THREADS: usize = 1;

/// Index of a region in [`Store::mem`].
pub(crate) fn ridx(r: LocalRegion) -> usize {
    LocalRegion::ALL.iter().position(|x| *x == r).expect("listed")
}

/// Little-endian f32s from bytes.
pub(crate) fn f32s(b: &[u8]) -> Vec<f32> {
    debug_assert_eq!(b.len() % 4, 0, "f32s of a partial word");
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// Writes `v` as little-endian f32s at the start of `dst`.
pub(crate) fn put_f32s(dst: &mut [u8], v: &[f32]) {
    assert!(
        dst.len() >= v.len() * 4,
        "put_f32s: {} bytes for {} values",
        dst.len(),
        v.len()
    );
    for (d, x) in dst.chunks_exact_mut(4).zip(v) {
        d.copy_from_slice(&x.to_le_bytes());
    }
}

/// A rank's memory (values mode) and its executors' state.
#[derive(Debug)]
pub(crate) struct Store {
    /// Region memory, by [`ridx`] (values mode; empty regions otherwise).
    pub(crate) mem: Vec<Vec<u8>>,
    /// The server's accumulators, per window, shard-sized.
    acc: Vec<Vec<f32>>,
    /// Fold groups' partial sums, shaped like `acc` (values mode, `fold_group > 1`).
    partial: Vec<Vec<f32>>,
    /// The server's momentum, shard-sized (SGD with momentum).
    momentum: Vec<f32>,
    /// The momentum of the SFB layers this worker updates itself, per layer
    /// (as the runtime's workers keep it).
    sfb_momentum: HashMap<u32, Vec<f32>>,
    /// Values mode: (address, length) of the factor fragments delivered to
    /// this rank and not yet reconstructed from. A reconstruction must read
    /// peers' factors in these very buffers: a copy on the way is a violation.
    pub(crate) delivered: HashSet<(usize, usize)>,
}

impl Store {
    /// Rank `r`'s memory for `node`'s regions (values mode), zeroed.
    pub(crate) fn new(cfg: &SimConfig, node: &Node, r: u32) -> Store {
        let mem = if cfg.values {
            LocalRegion::ALL
                .iter()
                .map(|&x| vec![0u8; node.region_bytes(x) as usize])
                .collect()
        } else {
            vec![Vec::new(); LocalRegion::ALL.len()]
        };
        let n = if cfg.values { cfg.book.shard_len(r) } else { 0 };
        let windows = node.windows();
        Store {
            mem,
            acc: vec![vec![0.0; n]; windows],
            partial: if cfg.values && cfg.sched.fold_group > 1 {
                vec![vec![0.0; n]; windows]
            } else {
                Vec::new()
            },
            momentum: if cfg.apply.needs_momentum() {
                vec![0.0; n]
            } else {
                Vec::new()
            },
            sfb_momentum: HashMap::default(),
            delivered: HashSet::default(),
        }
    }

    /// `len` f32s of `region` from byte `offset`.
    fn read(&self, region: LocalRegion, offset: u64, len: usize) -> Vec<f32> {
        f32s(&self.mem[ridx(region)][offset as usize..offset as usize + len * 4])
    }

    /// Performs `job` of rank `r` (values mode: on its memory; otherwise only
    /// what the Node needs back, an encode's report). Returns the bytes the
    /// job hands back to the Node, or what broke.
    pub(crate) fn execute(&mut self, cfg: &SimConfig, r: u32, job: &Job) -> Result<Option<Vec<u8>>, String> {
        if !cfg.values {
            // Only what the Node needs back: an encode's report, at the run's density.
            return Ok(match &job.kind {
                JobKind::EncodeSparse { len, cap, .. } => {
                    let n = (cfg.sparse_density * *len as f64).round() as usize;
                    let pairs = (n <= *cap).then_some(n as u32);
                    let scanned = if pairs.is_some() { *len as u64 } else { 0 };
                    Some(EncodeReport { pairs, scanned }.to_bytes())
                }
                _ => None,
            });
        }
        match &job.kind {
            JobKind::CaptureFactors { factors, len, .. } => Ok(Some(
                self.mem[ridx(factors.region)][factors.offset as usize..(factors.offset + len) as usize].to_vec(),
            )),
            JobKind::EncodeSparse { src, len, dst, cap, .. } => Ok(Some(self.encode(*src, *len, *dst, *cap))),
            kind => self.run(cfg, r, kind).map(|()| None),
        }
    }

    /// The jobs that hand nothing back to the Node, on rank `r`'s memory.
    fn run(&mut self, cfg: &SimConfig, r: u32, kind: &JobKind) -> Result<(), String> {
        let book = &cfg.book;
        match kind {
            JobKind::Accumulate {
                window,
                acc_at,
                src,
                len,
                first,
                partial,
                pairs,
                ..
            } => {
                let data = match pairs {
                    None => self.read(src.region, src.offset, *len),
                    Some(n) => self.densify(*src, *len, *n).map_err(|e| format!("rank {r}: {e}"))?,
                };
                self.accumulate(*window as usize, *acc_at, &data, *first, *partial);
            }
            JobKind::FoldPartial {
                window, acc_at, len, ..
            } => {
                let w = *window as usize;
                let range = *acc_at..acc_at + len;
                cpu::add_assign(&mut self.acc[w][range.clone()], &self.partial[w][range]);
            }
            JobKind::Apply {
                window,
                shard_at,
                len,
                gradients,
                momentum,
                ..
            } => {
                let range = *shard_at..shard_at + len;
                self.apply(cfg, *window as usize, range, *gradients as usize, *momentum);
            }
            JobKind::Place { dst, data } => {
                let at = dst.offset as usize;
                let m = &mut self.mem[ridx(dst.region)];
                if matches!(data, Blob::Opaque(_)) {
                    return Err(format!(
                        "rank {r}: momentum of {} bytes came without its values",
                        data.len()
                    ));
                }
                let mut off = at;
                for p in data.pieces() {
                    // A peer's block: the received messages' own buffers, each once.
                    if !self.delivered.remove(&(p.as_ptr() as usize, p.len())) {
                        return Err(format!(
                            "rank {r} places {} bytes of momentum that are not a received message's buffer",
                            p.len()
                        ));
                    }
                    m[off..off + p.len()].copy_from_slice(p);
                    off += p.len();
                }
            }
            JobKind::Copy { src, dst, len } | JobKind::Publish { src, dst, len, .. } => {
                let data = self.mem[ridx(src.region)][src.offset as usize..(src.offset + len) as usize].to_vec();
                self.mem[ridx(dst.region)][dst.offset as usize..(dst.offset + len) as usize].copy_from_slice(&data);
            }
            JobKind::FactorsToGrad { layer, factors, grad } => {
                self.factors_to_grad(cfg, *layer, *factors, *grad);
            }
            JobKind::Reconstruct {
                layer,
                params,
                factors,
                momentum,
                ..
            } => {
                self.reconstruct(cfg, r, *layer, (*params, *momentum), factors)?;
            }
            JobKind::SumFactors {
                layer,
                window,
                acc_at,
                factors,
                ..
            } => {
                let sum = self.factor_sum(r, book, *layer, factors)?;
                self.acc[*window as usize][*acc_at..acc_at + sum.len()].copy_from_slice(&sum);
            }
            JobKind::CaptureFactors { .. } | JobKind::EncodeSparse { .. } => unreachable!("handed back by execute"),
        }
        Ok(())
    }

    /// Folds `data` into window `window`'s accumulator (or its fold group's
    /// partial sum) from element `at`: the first contribution is copied.
    fn accumulate(&mut self, window: usize, at: usize, data: &[f32], first: bool, partial: bool) {
        let into = if partial { &mut self.partial } else { &mut self.acc };
        let acc = &mut into[window][at..at + data.len()];
        if first {
            acc.copy_from_slice(data);
        } else {
            cpu::add_assign(acc, data);
        }
    }

    /// A PS layer handed in by its factors: this worker's own gradient UᵀV of
    /// `layer`, from its factors at `factors` into `grad`.
    fn factors_to_grad(&mut self, cfg: &SimConfig, layer: u32, factors: Loc, grad: Loc) {
        let k = cfg.book.config().batch;
        let l = &cfg.book.layers()[layer as usize];
        let uv = self.read(factors.region, factors.offset, k * (l.m + l.n));
        let mut g = vec![0f32; l.m * l.n];
        cpu::sf_rows(&uv[..k * l.m], &uv[k * l.m..], k, l.m, l.n, 0, &mut g);
        put_f32s(&mut self.mem[ridx(grad.region)][grad.offset as usize..], &g);
    }

    /// Encodes the `len` elements at `src` as pairs into `dst` unless more
    /// than `cap` are nonzero; the report the Node reads.
    fn encode(&mut self, src: Loc, len: usize, dst: Loc, cap: usize) -> Vec<u8> {
        let data = self.read(src.region, src.offset, len);
        // The staging of a slice is as long as its gradient (as in the runtime).
        let out = &mut self.mem[ridx(dst.region)][dst.offset as usize..dst.offset as usize + len * 4];
        let pairs = cpu::sparse_encode(&data, cap, out, THREADS);
        let scanned = if pairs.is_some() { len as u64 } else { 0 };
        let pairs = pairs.map(|n| n as u32);
        EncodeReport { pairs, scanned }.to_bytes()
    }

    /// A server applies window `window`'s sum of `gradients` contributions to
    /// the shard's elements `range`, with their momentum (at `at` in the
    /// `Moments` region where its layer may switch schemes, else its own).
    fn apply(
        &mut self,
        cfg: &SimConfig,
        window: usize,
        range: std::ops::Range<usize>,
        gradients: usize,
        at: Option<Loc>,
    ) {
        let acc = &self.acc[window][range.clone()];
        let bytes = range.start * 4..range.end * 4;
        let mut w = f32s(&self.mem[ridx(LocalRegion::Shard)][bytes.clone()]);
        if let Some(at) = at {
            let mut mom = self.read(at.region, at.offset, range.len());
            cpu::apply(cfg.apply, gradients, acc, &mut w, &mut mom);
            put_f32s(&mut self.mem[ridx(at.region)][at.offset as usize..], &mom);
        } else {
            let mom = if self.momentum.is_empty() {
                &mut [][..]
            } else {
                &mut self.momentum[range]
            };
            cpu::apply(cfg.apply, gradients, acc, &mut w, mom);
        }
        put_f32s(&mut self.mem[ridx(LocalRegion::Shard)][bytes], &w);
    }

    /// The `len` elements of a sparse push of `pairs` pairs at `src`,
    /// densified (checked: a peer wrote them).
    fn densify(&self, src: Loc, len: usize, pairs: u32) -> Result<Vec<f32>, sparse::SparseError> {
        let bytes = sparse::encoded_bytes(pairs as usize);
        let m = &self.mem[ridx(src.region)];
        let words: Vec<u32> = m[src.offset as usize..src.offset as usize + bytes]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let mut d = vec![0f32; len];
        cpu::sparse_densify(&words, pairs as usize, &mut d, THREADS)?;
        Ok(d)
    }

    /// SFB: worker `r` rebuilds `layer`'s gradient from every worker's factors
    /// and applies it to its own parameters at `params`, with the layer's
    /// momentum (at `at` in the `Moments` region where the layer may switch
    /// schemes, else its own).
    fn reconstruct(
        &mut self,
        cfg: &SimConfig,
        r: u32,
        layer: u32,
        (params, at): (Loc, Option<Loc>),
        factors: &[Blob],
    ) -> Result<(), String> {
        let book = &cfg.book;
        let sum = self.factor_sum(r, book, layer, factors)?;
        let range = params.offset as usize..params.offset as usize + sum.len() * 4;
        let mut w = f32s(&self.mem[ridx(params.region)][range.clone()]);
        // The mean and SGD divide by every gradient in the sum.
        let p1 = book.p1() * cfg.sched.learners as usize;
        if let Some(at) = at {
            let mut mom = self.read(at.region, at.offset, sum.len());
            cpu::apply(cfg.apply, p1, &sum, &mut w, &mut mom);
            put_f32s(&mut self.mem[ridx(at.region)][at.offset as usize..], &mom);
        } else {
            let mom = self.sfb_momentum.entry(layer).or_insert_with(|| {
                if cfg.apply.needs_momentum() {
                    vec![0.0; sum.len()]
                } else {
                    Vec::new()
                }
            });
            cpu::apply(cfg.apply, p1, &sum, &mut w, mom);
        }
        put_f32s(&mut self.mem[ridx(params.region)][range], &w);
        Ok(())
    }

    /// Σ_p U_pᵀ·V_p of `layer` over every worker's factors, in worker order
    /// ([`cpu::sf_sum`]), read where rank `r` received them: a peer's must be
    /// a received message's buffer (`delivered`), not a copy.
    fn factor_sum(&mut self, r: u32, book: &Book, layer: u32, factors: &[Blob]) -> Result<Vec<f32>, String> {
        let (k, l) = (book.config().batch, &book.layers()[layer as usize]);
        let (m, n) = (l.m, l.n);
        let me = book.cluster().worker_index(r);
        let mut scratch = vec![[Vec::new(), Vec::new()]; factors.len()];
        let mut refs: Vec<(&[f32], &[f32])> = Vec::with_capacity(factors.len());
        for (wi, (b, [su, sv])) in factors.iter().zip(scratch.iter_mut()).enumerate() {
            if Some(wi) != me {
                for p in b.pieces() {
                    if !self.delivered.remove(&(p.as_ptr() as usize, p.len())) {
                        return Err(format!(
                            "rank {r} sums layer {layer} from {} bytes of worker {wi}'s factors \
                             that are not a received message's buffer (a copy on the receive path)",
                            p.len()
                        ));
                    }
                }
            }
            let whole = b.len() == k * (m + n) * 4;
            match (b.f32s(0, k * m, su), b.f32s(k * m * 4, k * n, sv)) {
                (Some((u, _)), Some((v, _))) if whole => refs.push((u, v)),
                _ => return Err(format!("the sum of layer {layer} got factors {b:?}")),
            }
        }
        let mut out = vec![0f32; m * n];
        cpu::sf_sum(&refs, k, m, n, &mut out);
        Ok(out)
    }
}

/// `job`'s modelled time on its executor, ns, at `cfg`'s rates.
pub(crate) fn job_ns(cfg: &SimConfig, job: &Job) -> u64 {
    let c = cfg;
    let book = &c.book;
    let secs = match &job.kind {
        JobKind::Accumulate { len, pairs: None, .. } | JobKind::FoldPartial { len, .. } => {
            *len as f64 * 4.0 / c.agg_bytes_per_s
        }
        JobKind::Accumulate {
            len, pairs: Some(n), ..
        } => {
            *len as f64 * 4.0 / c.agg_bytes_per_s
                + (*len as f64 * c.sparse.densify_ns_per_elem + f64::from(*n) * c.sparse.densify_ns_per_pair) / 1e9
        }
        JobKind::EncodeSparse { len, .. } => {
            let pairs = c.sparse_density * *len as f64;
            (*len as f64 * c.sparse.encode_ns_per_elem + pairs * c.sparse.encode_ns_per_pair) / 1e9
        }
        JobKind::Apply { len, .. } => apply_secs(c, *len as f64),
        JobKind::Copy { len, .. } | JobKind::CaptureFactors { len, .. } | JobKind::Publish { len, .. } => {
            *len as f64 / c.copy_bytes_per_s
        }
        JobKind::Place { data, .. } => data.len() as f64 / c.copy_bytes_per_s,
        JobKind::FactorsToGrad { layer, .. } => {
            let l = &book.layers()[*layer as usize];
            2.0 * (book.config().batch * l.m * l.n) as f64 / c.gemm_flops
        }
        JobKind::SumFactors { layer, .. } => {
            let l = &book.layers()[*layer as usize];
            2.0 * (book.config().batch * l.m * l.n * book.p1()) as f64 / c.gemm_flops
        }
        // The runtime's rebuild applies the gradient it formed to the layer
        // in the same job (`exec::reconstruct`): the update of M·N
        // parameters after the P1 products.
        JobKind::Reconstruct { layer, .. } => {
            let l = &book.layers()[*layer as usize];
            2.0 * (book.config().batch * l.m * l.n * book.p1()) as f64 / c.gemm_flops + apply_secs(c, l.params() as f64)
        }
    };
    (secs * 1e9) as u64
}

/// Seconds to update `len` parameters from their summed gradient: two
/// sums' worth of bytes (the update reads the sum, the parameters and the
/// momentum, and writes two of them), wherever it runs (a server's
/// `Apply`, an SFB worker's `Reconstruct`).
fn apply_secs(c: &SimConfig, len: f64) -> f64 {
    len * 8.0 / c.agg_bytes_per_s
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tidewire_engine::book::{LayerKind, LayerSpec};
    use tidewire_engine::node::Queue;
    use tidewire_engine::{Book, BookConfig, Cluster, SyncMode};

    use super::*;

    #[test]
    fn a_rebuild_is_charged_its_products_and_the_update_it_applies() {
        let (m, n, k) = (96usize, 80usize, 4usize);
        let layers = vec![LayerSpec::new("fc", LayerKind::Fc, m, n)];
        let mode = SyncMode::Hybrid;
        let bc = mode.book_config(BookConfig {
            batch: k,
            ..Default::default()
        });
        let book = Arc::new(Book::new(Cluster::split(3, 1).unwrap(), layers, bc).unwrap());
        let mut cfg = SimConfig::new(book.clone(), mode, vec![(1, 1)], 1);
        cfg.gemm_flops = 1e9;
        cfg.agg_bytes_per_s = 2e9;
        let loc = Loc {
            region: LocalRegion::Shard,
            offset: 0,
        };
        let job = |kind| Job {
            id: 1,
            queue: Queue::Worker,
            kind,
        };
        let products = 2.0 * (k * m * n * book.p1()) as f64 / 1e9;
        let update = (m * n) as f64 * 8.0 / 2e9;
        let rebuild = job(JobKind::Reconstruct {
            layer: 0,
            iter: 0,
            params: loc,
            factors: Vec::new(),
            momentum: None,
        });
        assert_eq!(job_ns(&cfg, &rebuild), ((products + update) * 1e9) as u64);
        // The same update as a server's Apply of the layer.
        let apply = job(JobKind::Apply {
            window: 0,
            chunk: 0,
            shard_at: 0,
            len: m * n,
            iter: 0,
            gradients: 0,
            momentum: None,
        });
        assert_eq!(job_ns(&cfg, &apply), (update * 1e9) as u64);
    }
}

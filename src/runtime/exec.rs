//! The compute executors: the Node's jobs run here, off the I/O thread, and
//! come back as inputs.
//!
//! Two threads, one per [`Queue`]: the server queue (accumulate into the
//! shard's accumulators, apply, seeding copies) owns the Nexus aggregator,
//! which places each chunk on the CPU or the GPU; the worker queue
//! (reconstruction from sufficient factors, forming a gradient from factors,
//! publishing a layer, local broadcasts) owns the SFB layers' momentum.
//! Jobs of one queue run in the order the Node emitted them; the two queues
//! run concurrently. Every job reaches the caller's memory through a
//! [`Lease`], so a job that would touch a range the caller holds fails instead
//! of racing it; memory a peer writes (landing slots, and the parameters a
//! `Publish` reads under SSP) is read with relaxed loads, never as a slice.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use tidewire_engine::node::{Blob, Job, JobKind, Loc, LocalRegion, Queue};
use tidewire_engine::{ApplyOp, Book};
use tidewire_gpu::agg::{AggStats, Aggregator, Policy};
use tidewire_gpu::cpu;
use tidewire_transport::{Lease, Region, Waker};

use super::job_error::{JobError, JobResult as Jr};
use super::snapshot::{ServerSnap, WorkerMomentum};
use crate::config::CkptRun;
use crate::error::{Error, Result};

/// This rank's registered regions, by role.
#[derive(Debug, Default)]
pub(crate) struct Memory {
    regions: HashMap<LocalRegion, Region>,
}

impl Memory {
    pub(crate) fn insert(&mut self, r: LocalRegion, region: Region) {
        self.regions.insert(r, region);
    }
    pub(crate) fn get(&self, r: LocalRegion) -> Jr<&Region> {
        self.regions.get(&r).ok_or(JobError::NoRegion { region: r })
    }
    pub(crate) fn region(&self, r: LocalRegion) -> Option<&Region> {
        self.regions.get(&r)
    }
    fn lease(&self, at: Loc, len: u64) -> Jr<Lease> {
        self.get(at.region)?
            .lease(at.offset as usize, len as usize)
            .map_err(|source| JobError::Lease {
                region: at.region,
                offset: at.offset,
                len,
                source,
            })
    }
}

/// A finished job.
#[derive(Debug)]
pub(crate) struct JobResult {
    pub(crate) id: u64,
    pub(crate) result: Jr<Option<Vec<u8>>>,
}

/// Where a job's result goes: the runtime's channel, and its wake-up.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    pub(crate) tx: Sender<JobResult>,
    pub(crate) waker: Waker,
    /// The first panic of any runtime thread, for the caller.
    pub(crate) panic: Arc<Mutex<Option<String>>>,
}

impl Reply {
    fn send(&self, r: JobResult) {
        let _ = self.tx.send(r);
        self.waker.wake();
    }
}

/// The two executors.
#[derive(Debug)]
pub(crate) struct Executors {
    server: Option<Sender<Job>>,
    worker: Option<Sender<Job>>,
    handles: Vec<JoinHandle<()>>,
    /// The aggregator's counters, refreshed after each server job.
    pub(crate) agg_stats: Arc<Mutex<AggStats>>,
    /// What the executors measured: how the reconstructions read the
    /// factors, and each kind of compute job's work and time.
    pub(crate) meters: Arc<Meters>,
}

/// What the executors measured while they ran (read into `SessionStats`).
#[derive(Debug, Default)]
pub(crate) struct Meters {
    pub(crate) reads: FactorReads,
    /// Gradients rebuilt from factors (SFB's reconstructions, and the
    /// dense gradient a worker forms from its own factors): FLOPs
    /// (2·K·M·N a gradient) and time.
    pub(crate) gemm: Meter,
    /// Contributions folded into an accumulator on the server executor:
    /// input bytes and time (wherever the aggregator placed them).
    pub(crate) sum: Meter,
    /// Updates applied (the server's chunks, SFB's layers): parameters and
    /// time, SFB's sum of the rebuilt gradients not included.
    pub(crate) apply: Meter,
}

/// Work done and the wall time it took, over every job of one kind.
#[derive(Debug, Default)]
pub(crate) struct Meter {
    pub(crate) work: AtomicU64,
    pub(crate) ns: AtomicU64,
}

impl Meter {
    /// Runs `f`, counting `work` and its wall time.
    fn time<T>(&self, work: u64, f: impl FnOnce() -> T) -> T {
        let t = std::time::Instant::now();
        let r = f();
        self.record(work, t);
        r
    }

    /// Counts `work` done since `start`.
    fn record(&self, work: u64, start: std::time::Instant) {
        self.ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.work.fetch_add(work, Ordering::Relaxed);
    }
}

/// Bytes of factors (U and V, every worker's) the reconstructions read in
/// place, and bytes they had to decode first (see [`factor_views`]).
#[derive(Debug, Default)]
pub(crate) struct FactorReads {
    pub(crate) in_place: AtomicU64,
    pub(crate) decoded: AtomicU64,
}

pub(crate) struct ServerSetup {
    pub(crate) policy: Policy,
    pub(crate) windows: usize,
    pub(crate) shard_len: usize,
}

use crate::error::panic_message;

/// Threads a sparse encode or densify may use: the machine's, at most 8.
fn sparse_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(8)
}

impl Executors {
    /// Starts the executors this rank needs. Returns the aggregator's
    /// description for the log, or its error (a GPU asked for and not usable).
    /// `apply` is the op and the local learners per worker (the mean and SGD
    /// divide by workers × learners).
    /// `ckpt` carries the checkpoint writer (the server executor snapshots
    /// its momentum) and the checkpoint a resumed job starts from (both
    /// executors take their momentum from it); `momentum` is the worker
    /// executor's, shared with the runtime's snapshots.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        book: Arc<Book>,
        apply: (ApplyOp, u32),
        mem: Arc<Memory>,
        server: Option<ServerSetup>,
        worker: bool,
        reply: Reply,
        rank: u32,
        ckpt: &CkptRun,
        momentum: WorkerMomentum,
    ) -> Result<(Self, Option<String>)> {
        let (op, learners) = apply;
        let gradients = book.p1() * learners.max(1) as usize;
        let agg_stats = Arc::new(Mutex::new(AggStats::default()));
        let mut ex = Executors {
            server: None,
            worker: None,
            handles: Vec::new(),
            agg_stats: agg_stats.clone(),
            meters: Arc::default(),
        };
        let mut describe = None;
        if let Some(s) = server {
            let (tx, rx) = crossbeam_channel::unbounded::<Job>();
            let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
            let (book, mem, reply) = (book.clone(), mem.clone(), reply.clone());
            let meters = ex.meters.clone();
            let snap = ckpt.writer.clone().map(|w| ServerSnap::new(w, book.clone(), rank));
            let mut momentum = if op.needs_momentum() {
                vec![0.0; s.shard_len]
            } else {
                Vec::new()
            };
            if let (Some(l), false) = (&ckpt.loaded, momentum.is_empty()) {
                // A resumed job: the shard's momentum from the checkpoint, chunk by chunk.
                for &c in book.server_chunks(rank) {
                    let ch = &book.chunks()[c as usize];
                    let from = l.momentum[ch.layer as usize]
                        .as_ref()
                        .and_then(|m| m.get(ch.offset..ch.offset + ch.len));
                    if let (Some(from), Some(to)) = (from, momentum.get_mut(ch.shard_offset..ch.shard_offset + ch.len))
                    {
                        to.copy_from_slice(from);
                    }
                }
            }
            let h = std::thread::Builder::new()
                .name(format!("tidewire-server-{rank}"))
                .spawn(move || {
                    // The aggregator (and its GPU context) lives on this thread.
                    let agg = match Aggregator::new(s.policy) {
                        Ok(a) => {
                            let _ = ready_tx.send(Ok(a.describe()));
                            a
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let mut st = ServerExec {
                        momentum,
                        snap,
                        acc: (0..s.windows).map(|_| vec![0.0; s.shard_len]).collect(),
                        partial: Vec::new(),
                        windows: s.windows,
                        gradients,
                        agg,
                        book,
                        mem,
                        op,
                        stats: agg_stats,
                        scratch: Vec::new(),
                        factor_scratch: Vec::new(),
                        meters,
                        threads: sparse_threads(),
                    };
                    run_queue(rx, &reply, |job| st.run(job));
                })
                .map_err(|e| Error::Thread {
                    what: "server executor",
                    reason: e.to_string(),
                })?;
            ex.handles.push(h);
            ex.server = Some(tx);
            match ready_rx.recv() {
                Ok(Ok(d)) => describe = Some(d),
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => {
                    return Err(Error::Thread {
                        what: "server executor",
                        reason: "it ended during setup".into(),
                    })
                }
            }
        }
        if worker {
            let (tx, rx) = crossbeam_channel::unbounded::<Job>();
            if let Some(l) = &ckpt.loaded {
                // A resumed job: the momentum of the layers this worker updates itself.
                let mut m = momentum.lock().unwrap_or_else(|p| p.into_inner());
                for (i, v) in l.momentum.iter().enumerate() {
                    if let (Some(v), true) = (v, book.scheme(i as u32, 0) == tidewire_engine::Scheme::Sfb) {
                        m.insert(i as u32, v.clone());
                    }
                }
            }
            let mut st = WorkerExec {
                gradients,
                momentum,
                scratch: Vec::new(),
                factor_scratch: Vec::new(),
                meters: ex.meters.clone(),
                threads: sparse_threads(),
                book,
                mem,
                op,
            };
            let h = std::thread::Builder::new()
                .name(format!("tidewire-worker-{rank}"))
                .spawn(move || run_queue(rx, &reply, |job| st.run(job)))
                .map_err(|e| Error::Thread {
                    what: "worker executor",
                    reason: e.to_string(),
                })?;
            ex.handles.push(h);
            ex.worker = Some(tx);
        }
        Ok((ex, describe))
    }

    /// Queues a job on its executor.
    pub(crate) fn submit(&self, job: Job) -> Jr<()> {
        let q = match job.queue {
            Queue::Server => &self.server,
            Queue::Worker => &self.worker,
        };
        match q {
            Some(tx) => tx.send(job).map_err(|_| JobError::ExecutorGone),
            None => Err(JobError::NoExecutor { queue: job.queue }),
        }
    }

    /// Stops the executors after their queued jobs.
    pub(crate) fn stop(&mut self) {
        self.server = None;
        self.worker = None;
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for Executors {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run_queue(rx: Receiver<Job>, reply: &Reply, mut f: impl FnMut(&Job) -> Jr<Option<Vec<u8>>>) {
    for job in rx {
        let id = job.id;
        let result = match std::panic::catch_unwind(AssertUnwindSafe(|| f(&job))) {
            Ok(r) => r,
            Err(p) => {
                let msg = panic_message(&*p);
                let mut slot = reply.panic.lock().unwrap_or_else(|e| e.into_inner());
                slot.get_or_insert_with(|| format!("a {:?} job panicked: {msg}", job.queue));
                Err(JobError::Panicked { message: msg })
            }
        };
        let failed = result.is_err();
        reply.send(JobResult { id, result });
        if failed && reply.panic.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            return;
        }
    }
}

/// Every worker's U (K×M) and V (K×N), in worker order, for
/// [`cpu::sf_sum`], read where they lie: in the buffers the transport
/// received them in ([`Blob::f32s`]). No copy when each lies in one buffer at
/// a 4-byte aligned address: every block that came in one message, and, as
/// the Node cuts blocks at the U/V boundary
/// ([`tidewire_engine::node::factors::fragments`]), U or V of a split block
/// when it fits a message alone. Otherwise (U or V over the message cap, a
/// peer that cut elsewhere, a misaligned buffer, a big-endian host) that
/// matrix is decoded into its `scratch`, which is kept for the next job.
/// Also returns how many bytes were read in place, and how many decoded.
type Views<'a> = (Vec<(&'a [f32], &'a [f32])>, [u64; 2]);
fn factor_views<'a>(
    factors: &'a [Blob],
    (k, m, n): (usize, usize, usize),
    scratch: &'a mut Vec<[Vec<f32>; 2]>,
) -> Jr<Views<'a>> {
    let want = k * (m + n) * 4;
    if scratch.len() < factors.len() {
        scratch.resize_with(factors.len(), Default::default);
    }
    let mut bytes = [0u64; 2];
    let mut views = Vec::with_capacity(factors.len());
    for (b, [su, sv]) in factors.iter().zip(scratch.iter_mut()) {
        match (b.f32s(0, k * m, su), b.f32s(k * m * 4, k * n, sv)) {
            (Some((u, du)), Some((v, dv))) if b.len() == want => {
                bytes[usize::from(du)] += (u.len() * 4) as u64;
                bytes[usize::from(dv)] += (v.len() * 4) as u64;
                views.push((u, v));
            }
            _ => return Err(JobError::FactorSize { got: b.len(), want }),
        }
    }
    Ok((views, bytes))
}

struct ServerExec {
    book: Arc<Book>,
    mem: Arc<Memory>,
    op: ApplyOp,
    agg: Aggregator,
    acc: Vec<Vec<f32>>,
    /// Fold groups' partial sums, shaped like `acc`; allocated at the first
    /// use (only a deterministic run with `fold_group > 1` has them).
    partial: Vec<Vec<f32>>,
    windows: usize,
    /// Gradients in every sum (workers × local learners): the mean's divisor.
    gradients: usize,
    momentum: Vec<f32>,
    /// Checkpoints: the shard's momentum, copied as each chunk is applied.
    snap: Option<ServerSnap>,
    stats: Arc<Mutex<AggStats>>,
    /// A landing slot's contents, copied out before they are summed.
    scratch: Vec<f32>,
    /// Adam: per worker, U and V of a factor block that had to be decoded.
    factor_scratch: Vec<[Vec<f32>; 2]>,
    /// Adam: factor bytes read in place and decoded (with the workers').
    meters: Arc<Meters>,
    /// Threads for densifying large sparse slices.
    threads: usize,
}

/// Where one sum goes: a slice of a chunk's accumulator in a window.
#[derive(Debug, Clone, Copy)]
struct SumAt {
    window: u32,
    chunk: u32,
    /// The slice's first element in the shard.
    acc_at: usize,
    len: usize,
    /// The first contribution of its round: copied, not added.
    first: bool,
    contributions: usize,
}

/// `at.chunk`'s accumulator in `at.window`, and the offset of `at.acc_at` in it.
fn chunk_acc<'a>(book: &Book, acc: &'a mut [Vec<f32>], at: SumAt) -> Jr<(&'a mut [f32], usize)> {
    let ch = book
        .chunks()
        .get(at.chunk as usize)
        .ok_or(JobError::outside("unknown chunk"))?;
    let (from, len) = (ch.shard_offset, ch.len);
    let off = at
        .acc_at
        .checked_sub(from)
        .ok_or(JobError::outside("slice before its chunk"))?;
    let acc = acc
        .get_mut(at.window as usize)
        .ok_or(JobError::outside("unknown window"))?
        .get_mut(from..from + len)
        .ok_or(JobError::outside("chunk outside the shard"))?;
    Ok((acc, off))
}

impl ServerExec {
    fn run(&mut self, job: &Job) -> Jr<Option<Vec<u8>>> {
        let r = match &job.kind {
            JobKind::Accumulate {
                window,
                chunk,
                acc_at,
                src,
                len,
                first,
                partial,
                contributions,
                pairs,
            } => {
                let at = SumAt {
                    window: *window,
                    chunk: *chunk,
                    acc_at: *acc_at,
                    len: *len,
                    first: *first,
                    contributions: *contributions,
                };
                let t = std::time::Instant::now();
                self.accumulate(at, *src, *pairs, *partial)?;
                self.meters.sum.record(*len as u64 * 4, t);
                None
            }
            JobKind::FoldPartial {
                window,
                chunk,
                acc_at,
                len,
                contributions,
            } => {
                let at = SumAt {
                    window: *window,
                    chunk: *chunk,
                    acc_at: *acc_at,
                    len: *len,
                    first: false,
                    contributions: *contributions,
                };
                self.fold_partial(at)?;
                None
            }
            JobKind::Apply {
                window,
                chunk,
                shard_at,
                len,
                iter,
                gradients,
                momentum,
            } => {
                let at = (*window, *chunk, *iter, *gradients);
                self.apply(at, *shard_at..shard_at + len, *momentum)?;
                None
            }
            JobKind::SumFactors {
                layer,
                window,
                acc_at,
                factors,
                ..
            } => {
                self.sum_factors(*layer, *window, *acc_at, factors)?;
                None
            }
            JobKind::Copy { src, dst, len } => copy(&self.mem, *src, *dst, *len)?,
            JobKind::Place { dst, data } => place(&self.mem, *dst, data)?,
            other => {
                return Err(JobError::WrongQueue {
                    side: "server",
                    job: format!("{other:?}"),
                })
            }
        };
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = self.agg.stats();
        Ok(r)
    }

    /// The aggregator's key of a chunk's accumulator in a window.
    fn key(&self, window: u32, chunk: u32) -> u64 {
        u64::from(window) * self.book.chunks().len() as u64 + u64::from(chunk)
    }

    /// One worker's slice, from its landing slot (or the rank's own
    /// gradient), into the chunk's accumulator or a fold group's partial sum.
    fn accumulate(&mut self, at: SumAt, src: Loc, pairs: Option<u32>, partial: bool) -> Jr<()> {
        self.book
            .chunks()
            .get(at.chunk as usize)
            .ok_or(JobError::outside("unknown chunk"))?;
        let len = at.len;
        // A landing slot is memory a peer writes: the protocol keeps it quiet
        // until its credit goes back, but a peer that broke it could write
        // now. Copy it out with relaxed loads rather than read it as a slice.
        if pairs.is_none() && !partial && src.region.remote_write() {
            // Read and added block by block (`Aggregator::accumulate_from`): the
            // block stays in the L1 cache between the two.
            let key = self.key(at.window, at.chunk);
            // Each block is its own relaxed read, so the region's lease lock (which the
            // receive path takes too) is held for one block at a time, never for an add.
            let region = self.mem.get(src.region)?;
            let (acc, off) = chunk_acc(&self.book, &mut self.acc, at)?;
            return self.agg.accumulate_from(
                key,
                at.contributions,
                acc,
                off,
                len,
                at.first,
                &mut self.scratch,
                |i, dst| Ok::<_, JobError>(region.read_f32_relaxed(src.offset as usize + i * 4, dst)?),
            );
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        let lease;
        let data: &[f32] = if let Some(n) = pairs {
            // A sparse push: read its words the same way, then densify them
            // (checked: a peer wrote them) into the slice it stands for.
            let n = n as usize;
            let mut words = vec![0f32; 2 + 2 * n];
            self.mem
                .get(src.region)?
                .read_f32_relaxed(src.offset as usize, &mut words)?;
            let words: Vec<u32> = words.iter().map(|w| w.to_bits()).collect();
            scratch.resize(len, 0.0);
            cpu::sparse_densify(&words, n, &mut scratch[..len], self.threads)
                .map_err(|source| JobError::Sparse { len, source })?;
            &scratch[..len]
        } else if src.region.remote_write() {
            scratch.resize(len, 0.0);
            self.mem
                .get(src.region)?
                .read_f32_relaxed(src.offset as usize, &mut scratch[..len])?;
            &scratch[..len]
        } else {
            lease = self.mem.lease(src, len as u64 * 4)?;
            lease.as_f32()?
        };
        let r = if partial {
            self.add_partial(at, data)
        } else {
            let key = self.key(at.window, at.chunk);
            let (acc, off) = chunk_acc(&self.book, &mut self.acc, at)?;
            self.agg
                .accumulate(key, at.contributions, acc, off, data, at.first)
                .map_err(JobError::from)
        };
        self.scratch = scratch;
        r
    }

    /// A fold group's partial sum: on the CPU, in group order.
    fn add_partial(&mut self, at: SumAt, data: &[f32]) -> Jr<()> {
        if self.partial.is_empty() {
            let n = self.acc.first().map_or(0, Vec::len);
            self.partial = (0..self.windows).map(|_| vec![0.0; n]).collect();
        }
        let dst = self
            .partial
            .get_mut(at.window as usize)
            .ok_or(JobError::outside("unknown window"))?
            .get_mut(at.acc_at..at.acc_at + at.len)
            .ok_or(JobError::outside("slice outside the shard"))?;
        if at.first {
            dst.copy_from_slice(data);
        } else {
            cpu::add_assign(dst, data);
        }
        Ok(())
    }

    /// A fold group's partial sum into the chunk's accumulator.
    fn fold_partial(&mut self, at: SumAt) -> Jr<()> {
        let part = self
            .partial
            .get(at.window as usize)
            .and_then(|p| p.get(at.acc_at..at.acc_at + at.len))
            .ok_or(JobError::outside("a fold group's partial sum that was never formed"))?;
        let key = self.key(at.window, at.chunk);
        let (acc, off) = chunk_acc(&self.book, &mut self.acc, at)?;
        self.agg.accumulate(key, at.contributions, acc, off, part, false)?;
        Ok(())
    }

    /// A chunk's sum is complete: apply it to the shard (and snapshot the
    /// momentum when a checkpoint is due), with the chunk's momentum at
    /// `at` where its layer may switch schemes (the `Moments` region), else
    /// the executor's own.
    fn apply(
        &mut self,
        (window, chunk, iter, gradients): (u32, u32, u64, u32),
        range: std::ops::Range<usize>,
        at: Option<Loc>,
    ) -> Jr<()> {
        let key = self.key(window, chunk);
        let acc = self
            .acc
            .get_mut(window as usize)
            .ok_or(JobError::outside("unknown window"))?
            .get_mut(range.clone())
            .ok_or(JobError::outside("chunk outside the shard"))?;
        self.agg.finish(key, acc)?;
        let mut dst = self.mem.lease(
            Loc {
                region: LocalRegion::Shard,
                offset: range.start as u64 * 4,
            },
            range.len() as u64 * 4,
        )?;
        let mut moved = at.map(|at| self.mem.lease(at, range.len() as u64 * 4)).transpose()?;
        let mom = match moved.as_mut() {
            Some(m) => m.as_f32_mut()?,
            None if self.momentum.is_empty() => &mut [][..],
            None => &mut self.momentum[range],
        };
        // The gradients in this sum: every worker's (× local learners)
        // under the `All` trigger, the contributors' under the others.
        let n = if gradients > 0 {
            gradients as usize
        } else {
            self.gradients
        };
        let (op, dst) = (self.op, dst.as_f32_mut()?);
        self.meters
            .apply
            .time(dst.len() as u64, || cpu::apply(op, n, acc, dst, mom));
        if let Some(snap) = &mut self.snap {
            snap.applied(chunk, iter, mom)?;
        }
        Ok(())
    }

    /// Adam's server: the layer's gradient, rebuilt from every worker's
    /// factors in worker order, where the PS would have folded the gradients
    /// (the same sums, element by element).
    fn sum_factors(&mut self, layer: u32, window: u32, acc_at: usize, factors: &[Blob]) -> Jr<()> {
        let k = self.book.config().batch;
        let l = self
            .book
            .layers()
            .get(layer as usize)
            .ok_or(JobError::outside("unknown layer"))?;
        let (m, n, params) = (l.m, l.n, l.params());
        let (uv, [in_place, decoded]) = factor_views(factors, (k, m, n), &mut self.factor_scratch)?;
        self.meters.reads.in_place.fetch_add(in_place, Ordering::Relaxed);
        self.meters.reads.decoded.fetch_add(decoded, Ordering::Relaxed);
        let acc = self
            .acc
            .get_mut(window as usize)
            .ok_or(JobError::outside("unknown window"))?
            .get_mut(acc_at..acc_at + params)
            .ok_or(JobError::outside("layer outside the shard"))?;
        cpu::sf_sum(&uv, k, m, n, acc);
        Ok(())
    }
}

/// A peer's bytes (a chunk's momentum at a scheme switch) written at `dst`.
fn place(mem: &Memory, dst: Loc, data: &Blob) -> Jr<Option<Vec<u8>>> {
    if matches!(data, Blob::Opaque(_)) {
        return Err(JobError::outside("momentum without its bytes"));
    }
    let mut d = mem.lease(dst, data.len() as u64)?;
    let mut at = 0;
    for p in data.pieces() {
        d.as_bytes_mut()[at..at + p.len()].copy_from_slice(p);
        at += p.len();
    }
    debug_assert_eq!(at, data.len(), "every piece placed");
    Ok(None)
}

fn copy(mem: &Memory, src: Loc, dst: Loc, len: u64) -> Jr<Option<Vec<u8>>> {
    let s = mem.lease(src, len)?;
    let mut d = mem.lease(dst, len)?;
    d.as_bytes_mut().copy_from_slice(s.as_bytes());
    Ok(None)
}

struct WorkerExec {
    /// Gradients in every sum (workers × local learners): the mean's divisor.
    gradients: usize,
    book: Arc<Book>,
    mem: Arc<Memory>,
    op: ApplyOp,
    momentum: WorkerMomentum,
    scratch: Vec<f32>,
    /// Per worker: U and V of a factor block that had to be decoded (see [`factor_views`]).
    factor_scratch: Vec<[Vec<f32>; 2]>,
    meters: Arc<Meters>,
    /// Threads for encoding large sparse slices.
    threads: usize,
}

impl WorkerExec {
    fn run(&mut self, job: &Job) -> Jr<Option<Vec<u8>>> {
        let book = self.book.clone();
        let k = book.config().batch;
        match &job.kind {
            JobKind::Copy { src, dst, len } => copy(&self.mem, *src, *dst, *len),
            JobKind::Place { dst, data } => place(&self.mem, *dst, data),
            JobKind::FactorsToGrad { layer, factors, grad } => {
                let l = book
                    .layers()
                    .get(*layer as usize)
                    .ok_or(JobError::outside("unknown layer"))?;
                let f = self.mem.lease(*factors, (k * (l.m + l.n) * 4) as u64)?;
                let mut g = self.mem.lease(*grad, (l.params() * 4) as u64)?;
                let uv = f.as_f32()?;
                let (u, v) = uv.split_at(k * l.m);
                let g = g.as_f32_mut()?;
                let flops = 2 * (k * l.m * l.n) as u64;
                self.meters.gemm.time(flops, || cpu::sf_rows(u, v, k, l.m, l.n, 0, g));
                Ok(None)
            }
            JobKind::CaptureFactors { factors, len, .. } => {
                let f = self.mem.lease(*factors, *len)?;
                Ok(Some(f.as_bytes().to_vec()))
            }
            JobKind::Reconstruct {
                layer,
                params,
                factors,
                momentum,
                ..
            } => {
                self.reconstruct(*layer, (*params, *momentum), factors)?;
                Ok(None)
            }
            JobKind::EncodeSparse { src, len, dst, cap, .. } => {
                let s = self.mem.lease(*src, *len as u64 * 4)?;
                // The staging of a slice is as long as its gradient.
                let mut d = self.mem.lease(*dst, *len as u64 * 4)?;
                let pairs = cpu::sparse_encode(s.as_f32()?, *cap, d.as_bytes_mut(), self.threads);
                let report = tidewire_engine::sparse::EncodeReport {
                    pairs: pairs.map(|n| n as u32),
                    scanned: if pairs.is_some() { *len as u64 } else { 0 },
                };
                Ok(Some(report.to_bytes()))
            }
            JobKind::Publish { src, dst, len, .. } => {
                // Servers may be writing the source right now (SSP): read it
                // element by element through relaxed atomics, never as a slice.
                let s = self.mem.get(src.region)?;
                let mut d = self.mem.lease(*dst, *len)?;
                s.read_f32_relaxed(src.offset as usize, d.as_f32_mut()?)?;
                Ok(None)
            }
            other => Err(JobError::WrongQueue {
                side: "worker",
                job: format!("{other:?}"),
            }),
        }
    }

    /// SFB: layer `layer`'s gradient rebuilt from every worker's factors, in
    /// worker order, and applied to its parameters with this worker's own
    /// momentum for the layer: at `at` where the layer may switch schemes
    /// (the `Moments` region), else the executor's.
    fn reconstruct(&mut self, layer: u32, (params, at): (Loc, Option<Loc>), factors: &[Blob]) -> Jr<()> {
        let k = self.book.config().batch;
        let book = self.book.clone();
        let l = book
            .layers()
            .get(layer as usize)
            .ok_or(JobError::outside("unknown layer"))?;
        let (uv, [in_place, decoded]) = factor_views(factors, (k, l.m, l.n), &mut self.factor_scratch)?;
        self.meters.reads.in_place.fetch_add(in_place, Ordering::Relaxed);
        self.meters.reads.decoded.fetch_add(decoded, Ordering::Relaxed);
        self.scratch.resize(l.params(), 0.0);
        let flops = 2 * (uv.len() * k * l.m * l.n) as u64;
        let scratch = &mut self.scratch[..l.params()];
        self.meters.gemm.time(flops, || cpu::sf_sum(&uv, k, l.m, l.n, scratch));
        let mut p = self.mem.lease(params, (l.params() * 4) as u64)?;
        let op = self.op;
        let mut moved = at.map(|at| self.mem.lease(at, (l.params() * 4) as u64)).transpose()?;
        let mut momentum = self.momentum.lock().unwrap_or_else(|p| p.into_inner());
        let mom = match moved.as_mut() {
            Some(m) => m.as_f32_mut()?,
            None => momentum.entry(layer).or_insert_with(|| {
                if op.needs_momentum() {
                    vec![0.0; l.params()]
                } else {
                    Vec::new()
                }
            }),
        };
        let (grad, p) = (&self.scratch[..l.params()], p.as_f32_mut()?);
        let n = self.gradients;
        self.meters
            .apply
            .time(p.len() as u64, || cpu::apply(op, n, grad, p, mom));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use tidewire_engine::node::factors::fragments;

    use super::*;

    use tidewire_engine::testkit::next;

    /// A block as the Node hands it over: one message's buffer, or its fragments.
    fn blob_of(mut pieces: Vec<Vec<u8>>) -> Blob {
        if pieces.len() == 1 {
            Blob::Bytes(pieces.pop().expect("one piece"))
        } else {
            Blob::Fragments(pieces)
        }
    }

    fn le(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Values whose products and sums round, so any change of order shows.
    fn values(rng: &mut u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| ((next(rng) % 2001) as f32 - 1000.0) * 1e-3 * (1 << (next(rng) % 12)) as f32)
            .collect()
    }

    /// What the reconstruction did before blobs were read in place: each
    /// block decoded into its own `Vec<f32>`, then `sf_sum`.
    fn reference(blocks: &[Vec<f32>], k: usize, m: usize, n: usize) -> Vec<u32> {
        let refs: Vec<(&[f32], &[f32])> = blocks.iter().map(|b| b.split_at(k * m)).collect();
        let mut out = vec![0f32; m * n];
        cpu::sf_sum(&refs, k, m, n, &mut out);
        out.iter().map(|x| x.to_bits()).collect()
    }

    /// The sum's bits and the bytes decoded.
    fn sum(blobs: &[Blob], k: usize, m: usize, n: usize, scratch: &mut Vec<[Vec<f32>; 2]>) -> (Vec<u32>, u64) {
        let (uv, [in_place, decoded]) = factor_views(blobs, (k, m, n), scratch).unwrap();
        assert_eq!(in_place + decoded, (blobs.len() * k * (m + n) * 4) as u64);
        let mut out = vec![0f32; m * n];
        cpu::sf_sum(&uv, k, m, n, &mut out);
        (out.iter().map(|x| x.to_bits()).collect(), decoded)
    }

    /// The buffer that starts at byte `at` of a blob, if one does.
    fn piece_at(b: &Blob, at: usize) -> *const u8 {
        let mut start = 0;
        for p in b.pieces() {
            if start == at {
                return p.as_ptr();
            }
            start += p.len();
        }
        panic!("no piece starts at {at}")
    }

    #[test]
    fn reconstruction_reads_the_received_buffers() {
        let (k, m, n) = (3, 70, 5);
        let mut rng = 7;
        let blocks: Vec<Vec<f32>> = (0..4).map(|_| values(&mut rng, k * (m + n))).collect();
        // Worker 0: whole; 1: cut at U/V by the Node's rule; 2 and 3: cut
        // elsewhere, 3 where its V starts at an address that is not 4-aligned.
        let cap = (k * m * 4) as u64;
        let bytes: Vec<Vec<u8>> = blocks.iter().map(|b| le(b)).collect();
        let cut = |b: &[u8], cuts: &[(u64, u64)]| -> Vec<Vec<u8>> {
            cuts.iter()
                .map(|&(o, l)| b[o as usize..(o + l) as usize].to_vec())
                .collect()
        };
        let total = bytes[0].len() as u64;
        let blobs = vec![
            Blob::Bytes(bytes[0].clone()),
            Blob::Fragments(cut(&bytes[1], &fragments(cap, total, cap).collect::<Vec<_>>())),
            Blob::Fragments(cut(&bytes[2], &[(0, 8), (8, total - 8)])),
            Blob::Fragments(cut(&bytes[3], &[(0, 6), (6, total - 6)])),
        ];
        assert_eq!(blobs[1].pieces().len(), 2);
        let mut scratch = Vec::new();
        let (uv, [in_place, decoded]) = factor_views(&blobs, (k, m, n), &mut scratch).unwrap();
        // U and V of the first two are the received buffers themselves.
        for (w, (u, v)) in uv.iter().enumerate().take(2) {
            assert_eq!(
                u.as_ptr().cast::<u8>(),
                piece_at(&blobs[w], 0),
                "worker {w}'s U was copied"
            );
            let vp = if w == 0 {
                piece_at(&blobs[0], 0).wrapping_add(k * m * 4)
            } else {
                piece_at(&blobs[1], k * m * 4)
            };
            assert_eq!(v.as_ptr().cast::<u8>(), vp, "worker {w}'s V was copied");
        }
        // The third's U spans two buffers: decoded; its V lies in one: read
        // there. The fourth's V lies in one buffer too, but misaligned: decoded.
        assert_eq!(decoded, (k * m * 4 * 2 + k * n * 4) as u64);
        assert_eq!(in_place, (k * (m + n) * 4 * 2 + k * n * 4) as u64);
        assert_eq!(
            uv[2].1.as_ptr().cast::<u8>(),
            blobs[2].pieces()[1].as_ptr().wrapping_add(k * m * 4 - 8)
        );
        let mut out = vec![0f32; m * n];
        cpu::sf_sum(&uv, k, m, n, &mut out);
        // Nothing was decoded for the first two.
        assert_eq!(
            scratch[0][0].capacity() + scratch[0][1].capacity() + scratch[1][0].capacity(),
            0
        );
        let got: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, reference(&blocks, k, m, n));
        assert!(factor_views(&[Blob::Opaque(total as usize)], (k, m, n), &mut scratch).is_err());
        assert!(factor_views(&[Blob::Bytes(vec![0; 8])], (k, m, n), &mut scratch).is_err());
    }

    #[test]
    fn split_blocks_reconstruct_to_the_bits_of_whole_ones() {
        let seed = tidewire_engine::testkit::seed("TIDEWIRE_FACTOR_SEED");
        let mut rng = seed;
        let mut scratch = Vec::new();
        let mut decodes = [0u64; 3];
        for case in 0..60 {
            let k = 1 + (next(&mut rng) % 9) as usize;
            let m = 1 + (next(&mut rng) % 150) as usize;
            let n = 1 + (next(&mut rng) % 40) as usize;
            let p = 1 + (next(&mut rng) % 4) as usize;
            let blocks: Vec<Vec<f32>> = (0..p).map(|_| values(&mut rng, k * (m + n))).collect();
            let want = reference(&blocks, k, m, n);
            let whole: Vec<Blob> = blocks.iter().map(|b| Blob::Bytes(le(b))).collect();
            let (got, decoded) = sum(&whole, k, m, n, &mut scratch);
            assert_eq!(got, want, "seed {seed} case {case}: whole blocks");
            assert_eq!(decoded, 0, "seed {seed} case {case}: a whole block was decoded");
            // The Node's cut at a random cap: U and V that fit are read in place.
            let total = (k * (m + n) * 4) as u64;
            let cap = 256 + next(&mut rng) % total.max(1);
            let (ub, vb) = ((k * m * 4) as u64, (k * n * 4) as u64);
            let frag = cap / 4 * 4;
            let mut expect = 0;
            let node: Vec<Blob> = blocks
                .iter()
                .map(|b| {
                    let b = le(b);
                    let pieces: Vec<Vec<u8>> = fragments(ub, total, cap)
                        .map(|(o, l)| b[o as usize..(o + l) as usize].to_vec())
                        .collect();
                    if total > cap {
                        expect += [ub, vb].iter().filter(|&&x| x > frag).sum::<u64>();
                    }
                    blob_of(pieces)
                })
                .collect();
            let (got, decoded) = sum(&node, k, m, n, &mut scratch);
            assert_eq!(got, want, "seed {seed} case {case}: cut by the Node at {cap}");
            assert_eq!(decoded, expect, "seed {seed} case {case}: cut by the Node at {cap}");
            decodes[1] += decoded;
            // Any cut, at any byte, f32s split across fragments included.
            let any: Vec<Blob> = blocks
                .iter()
                .map(|b| {
                    let b = le(b);
                    let mut cuts: Vec<usize> = (0..1 + next(&mut rng) % 8)
                        .map(|_| 1 + next(&mut rng) as usize % b.len())
                        .collect();
                    cuts.push(b.len());
                    cuts.sort_unstable();
                    cuts.dedup();
                    let mut from = 0;
                    let pieces: Vec<Vec<u8>> = cuts
                        .iter()
                        .map(|&c| {
                            let p = b[from..c].to_vec();
                            from = c;
                            p
                        })
                        .collect();
                    blob_of(pieces)
                })
                .collect();
            let (got, decoded) = sum(&any, k, m, n, &mut scratch);
            assert_eq!(got, want, "seed {seed} case {case}: cut anywhere");
            decodes[2] += decoded;
        }
        println!(
            "bytes decoded: whole 0, cut by the Node {}, cut anywhere {}",
            decodes[1], decodes[2]
        );
    }
}

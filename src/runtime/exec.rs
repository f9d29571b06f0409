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
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use tidewire_engine::node::{Blob, Job, JobKind, Loc, LocalRegion, Queue};
use tidewire_engine::{ApplyOp, Book};
use tidewire_gpu::agg::{AggStats, Aggregator, Policy};
use tidewire_gpu::cpu;
use tidewire_transport::{Lease, Region, Waker};

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
    pub(crate) fn get(&self, r: LocalRegion) -> std::result::Result<&Region, String> {
        self.regions
            .get(&r)
            .ok_or_else(|| format!("this rank has no {r:?} region"))
    }
    pub(crate) fn region(&self, r: LocalRegion) -> Option<&Region> {
        self.regions.get(&r)
    }
    fn lease(&self, at: Loc, len: u64) -> std::result::Result<Lease, String> {
        self.get(at.region)?
            .lease(at.offset as usize, len as usize)
            .map_err(|e| format!("{:?} at {}+{len}: {e}", at.region, at.offset))
    }
}

/// A finished job.
#[derive(Debug)]
pub(crate) struct JobResult {
    pub(crate) id: u64,
    pub(crate) result: std::result::Result<Option<Vec<u8>>, String>,
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
}

pub(crate) struct ServerSetup {
    pub(crate) policy: Policy,
    pub(crate) windows: usize,
    pub(crate) shard_len: usize,
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

impl Executors {
    /// Starts the executors this rank needs. Returns the aggregator's
    /// description for the log, or its error (a GPU asked for and not usable).
    pub(crate) fn start(
        book: Arc<Book>,
        op: ApplyOp,
        mem: Arc<Memory>,
        server: Option<ServerSetup>,
        worker: bool,
        reply: Reply,
        rank: u32,
    ) -> Result<(Self, Option<String>)> {
        let agg_stats = Arc::new(Mutex::new(AggStats::default()));
        let mut ex = Executors {
            server: None,
            worker: None,
            handles: Vec::new(),
            agg_stats: agg_stats.clone(),
        };
        let mut describe = None;
        if let Some(s) = server {
            let (tx, rx) = crossbeam_channel::unbounded::<Job>();
            let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
            let (book, mem, reply) = (book.clone(), mem.clone(), reply.clone());
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
                        momentum: if op.needs_momentum() {
                            vec![0.0; s.shard_len]
                        } else {
                            Vec::new()
                        },
                        acc: (0..s.windows).map(|_| vec![0.0; s.shard_len]).collect(),
                        agg,
                        book,
                        mem,
                        op,
                        stats: agg_stats,
                        scratch: Vec::new(),
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
            let mut st = WorkerExec {
                momentum: HashMap::new(),
                scratch: Vec::new(),
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
    pub(crate) fn submit(&self, job: Job) -> std::result::Result<(), String> {
        let q = match job.queue {
            Queue::Server => &self.server,
            Queue::Worker => &self.worker,
        };
        match q {
            Some(tx) => tx
                .send(job)
                .map_err(|_| "the executor is gone (it panicked?)".to_string()),
            None => Err(format!("a {:?} job on a rank without that role", job.queue)),
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

fn run_queue(
    rx: Receiver<Job>,
    reply: &Reply,
    mut f: impl FnMut(&Job) -> std::result::Result<Option<Vec<u8>>, String>,
) {
    for job in rx {
        let id = job.id;
        let result = match std::panic::catch_unwind(AssertUnwindSafe(|| f(&job))) {
            Ok(r) => r,
            Err(p) => {
                let msg = panic_message(&*p);
                let mut slot = reply.panic.lock().unwrap_or_else(|e| e.into_inner());
                slot.get_or_insert_with(|| format!("a {:?} job panicked: {msg}", job.queue));
                Err(format!("panicked: {msg}"))
            }
        };
        let failed = result.is_err();
        reply.send(JobResult { id, result });
        if failed && reply.panic.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            return;
        }
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

struct ServerExec {
    book: Arc<Book>,
    mem: Arc<Memory>,
    op: ApplyOp,
    agg: Aggregator,
    acc: Vec<Vec<f32>>,
    momentum: Vec<f32>,
    stats: Arc<Mutex<AggStats>>,
    /// A landing slot's contents, copied out before they are summed.
    scratch: Vec<f32>,
}

impl ServerExec {
    fn run(&mut self, job: &Job) -> std::result::Result<Option<Vec<u8>>, String> {
        let book = self.book.clone();
        let nchunks = book.chunks().len() as u64;
        let r = match &job.kind {
            JobKind::Accumulate {
                window,
                chunk,
                acc_at,
                src,
                len,
                first,
                contributions,
            } => {
                let ch = book.chunks().get(*chunk as usize).ok_or("unknown chunk")?;
                // A landing slot is memory a peer writes: the protocol keeps it quiet
                // until its credit goes back, but a peer that broke it could write
                // now. Copy it out with relaxed loads rather than read it as a slice.
                let mut scratch = std::mem::take(&mut self.scratch);
                let lease;
                let data: &[f32] = if src.region.remote_write() {
                    scratch.resize(*len, 0.0);
                    self.mem
                        .get(src.region)?
                        .read_f32_relaxed(src.offset as usize, &mut scratch[..*len])
                        .map_err(|e| e.to_string())?;
                    &scratch[..*len]
                } else {
                    lease = self.mem.lease(*src, *len as u64 * 4)?;
                    lease.as_f32().map_err(|e| e.to_string())?
                };
                let acc = self
                    .acc
                    .get_mut(*window as usize)
                    .ok_or("unknown window")?
                    .get_mut(ch.shard_offset..ch.shard_offset + ch.len)
                    .ok_or("chunk outside the shard")?;
                let key = u64::from(*window) * nchunks + u64::from(*chunk);
                let off = acc_at.checked_sub(ch.shard_offset).ok_or("slice before its chunk")?;
                self.agg
                    .accumulate(key, *contributions, acc, off, data, *first)
                    .map_err(|e| e.to_string())?;
                self.scratch = scratch;
                None
            }
            JobKind::Apply {
                window,
                chunk,
                shard_at,
                len,
                ..
            } => {
                let range = *shard_at..shard_at + len;
                let acc = self
                    .acc
                    .get_mut(*window as usize)
                    .ok_or("unknown window")?
                    .get_mut(range.clone())
                    .ok_or("chunk outside the shard")?;
                let key = u64::from(*window) * nchunks + u64::from(*chunk);
                self.agg.finish(key, acc).map_err(|e| e.to_string())?;
                let mut dst = self.mem.lease(
                    Loc {
                        region: LocalRegion::Shard,
                        offset: *shard_at as u64 * 4,
                    },
                    *len as u64 * 4,
                )?;
                let mom = if self.momentum.is_empty() {
                    &mut [][..]
                } else {
                    &mut self.momentum[range]
                };
                cpu::apply(
                    self.op,
                    book.p1(),
                    acc,
                    dst.as_f32_mut().map_err(|e| e.to_string())?,
                    mom,
                );
                None
            }
            JobKind::Copy { src, dst, len } => copy(&self.mem, *src, *dst, *len)?,
            other => return Err(format!("not a server job: {other:?}")),
        };
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = self.agg.stats();
        Ok(r)
    }
}

fn copy(mem: &Memory, src: Loc, dst: Loc, len: u64) -> std::result::Result<Option<Vec<u8>>, String> {
    let s = mem.lease(src, len)?;
    let mut d = mem.lease(dst, len)?;
    d.as_bytes_mut().copy_from_slice(s.as_bytes());
    Ok(None)
}

struct WorkerExec {
    book: Arc<Book>,
    mem: Arc<Memory>,
    op: ApplyOp,
    momentum: HashMap<u32, Vec<f32>>,
    scratch: Vec<f32>,
}

impl WorkerExec {
    fn run(&mut self, job: &Job) -> std::result::Result<Option<Vec<u8>>, String> {
        let book = self.book.clone();
        let k = book.config().batch;
        match &job.kind {
            JobKind::Copy { src, dst, len } => copy(&self.mem, *src, *dst, *len),
            JobKind::FactorsToGrad { layer, factors, grad } => {
                let l = book.layers().get(*layer as usize).ok_or("unknown layer")?;
                let f = self.mem.lease(*factors, (k * (l.m + l.n) * 4) as u64)?;
                let mut g = self.mem.lease(*grad, (l.params() * 4) as u64)?;
                let uv = f.as_f32().map_err(|e| e.to_string())?;
                let (u, v) = uv.split_at(k * l.m);
                cpu::sf_rows(u, v, k, l.m, l.n, 0, g.as_f32_mut().map_err(|e| e.to_string())?);
                Ok(None)
            }
            JobKind::CaptureFactors { factors, len, .. } => {
                let f = self.mem.lease(*factors, *len)?;
                Ok(Some(f.as_bytes().to_vec()))
            }
            JobKind::Reconstruct {
                layer, params, factors, ..
            } => {
                let l = book.layers().get(*layer as usize).ok_or("unknown layer")?;
                let want = k * (l.m + l.n) * 4;
                let mut parts = Vec::with_capacity(factors.len());
                for b in factors {
                    match b {
                        Blob::Bytes(b) if b.len() == want => parts.push(f32s(b)),
                        other => return Err(format!("factors of {} bytes, expected {want}", other.len())),
                    }
                }
                let refs: Vec<(&[f32], &[f32])> = parts.iter().map(|p| p.split_at(k * l.m)).collect();
                self.scratch.resize(l.params(), 0.0);
                cpu::sf_sum(&refs, k, l.m, l.n, &mut self.scratch[..l.params()]);
                let mut p = self.mem.lease(*params, (l.params() * 4) as u64)?;
                let op = self.op;
                let mom = self.momentum.entry(*layer).or_insert_with(|| {
                    if op.needs_momentum() {
                        vec![0.0; l.params()]
                    } else {
                        Vec::new()
                    }
                });
                cpu::apply(
                    op,
                    book.p1(),
                    &self.scratch[..l.params()],
                    p.as_f32_mut().map_err(|e| e.to_string())?,
                    mom,
                );
                Ok(None)
            }
            JobKind::Publish { src, dst, len, .. } => {
                // Servers may be writing the source right now (SSP): read it
                // element by element through relaxed atomics, never as a slice.
                let s = self.mem.get(src.region)?;
                let mut d = self.mem.lease(*dst, *len)?;
                s.read_f32_relaxed(src.offset as usize, d.as_f32_mut().map_err(|e| e.to_string())?)
                    .map_err(|e| e.to_string())?;
                Ok(None)
            }
            other => Err(format!("not a worker job: {other:?}")),
        }
    }
}

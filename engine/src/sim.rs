//! A deterministic discrete-event simulation of a whole cluster, driving the
//! product's own [`Worker`] and [`Server`] cores.
//!
//! - Virtual time in nanoseconds; ties break by event sequence, so a run is a
//!   pure function of its [`SimConfig`] (including the seed).
//! - Full-duplex NICs ([`crate::net`]): each rank has a transmit and a
//!   receive side of one link's bandwidth, shared fairly between the
//!   connections using it; messages on one connection go in order, and every
//!   transfer pays the latency.
//! - Worker compute follows a layer-time table (forward, backward per layer).
//! - Seeded faults: random extra delays, stragglers, a dead rank, a partition
//!   that heals.
//! - With `values`, real f32 data moves (gradients, landing slots,
//!   accumulators, parameters) and the invariants are checked as it runs: BSP
//!   values exact, nothing lost or applied twice, credits never exceeded, all
//!   workers equal after each iteration.
//!
//! A failed run returns `Err` with a message that starts with the seed.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use crate::book::{Book, Scheme};
use crate::config::{Consistency, SchedConfig, SyncMode};
use crate::net::Net;
use crate::server::{Server, ServerCommand};
use crate::worker::{Worker, WorkerCommand};

/// Faults to inject.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Probability that a transfer gets an extra random delay.
    pub delay_prob: f64,
    /// Largest extra delay, ns.
    pub delay_max_ns: u64,
    /// (worker rank, compute slowdown factor).
    pub stragglers: Vec<(u32, f64)>,
    /// (rank, time ns): the rank dies then; nothing it sends or is sent arrives.
    pub dead: Option<(u32, u64)>,
    /// (ranks on one side, from ns, to ns): traffic across the cut waits until `to`.
    pub partition: Option<(Vec<u32>, u64, u64)>,
}

/// A simulation run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The information book (cluster, layers, sizes).
    pub book: Arc<Book>,
    /// Scheduling settings.
    pub sched: SchedConfig,
    /// Whether layers are handed in as their backward ends (WFBP) or after the whole pass.
    pub wait_free: bool,
    /// Per-layer (forward, backward) compute, ns.
    pub layer_ns: Vec<(u64, u64)>,
    /// Link bandwidth, bit/s.
    pub bandwidth_bps: f64,
    /// One-way latency per transfer, ns.
    pub latency_ns: u64,
    /// Server aggregation throughput, bytes/s.
    pub agg_bytes_per_s: f64,
    /// SF reconstruction GEMM throughput, FLOP/s.
    pub gemm_flops: f64,
    /// Iterations.
    pub iters: u64,
    /// Seed for the faults.
    pub seed: u64,
    /// Faults.
    pub faults: Faults,
    /// Move real values and check them.
    pub values: bool,
    /// A run with no progress for this long fails (a liveness timeout), ns.
    pub stall_ns: u64,
}

impl SimConfig {
    /// A run of `book` in `mode` with sensible rates: 10 Gbit/s, 5 µs, 10 GB/s
    /// aggregation, 5 TFLOP/s GEMM, no faults.
    pub fn new(book: Arc<Book>, mode: SyncMode, layer_ns: Vec<(u64, u64)>, iters: u64) -> Self {
        SimConfig {
            book,
            sched: SchedConfig {
                order: mode.order(),
                ..SchedConfig::default()
            },
            wait_free: mode.wait_free(),
            layer_ns,
            bandwidth_bps: 10e9,
            latency_ns: 5_000,
            agg_bytes_per_s: 10e9,
            gemm_flops: 5e12,
            iters,
            seed: 1,
            faults: Faults::default(),
            values: false,
            stall_ns: 60_000_000_000,
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, Default)]
pub struct SimReport {
    /// Virtual time from the start of iteration 0 to the last layer synced, ns.
    pub total_ns: u64,
    /// `total_ns / iters`, seconds.
    pub iteration_s: f64,
    /// Time workers spent blocked waiting for layers (mean per worker per iteration), s.
    pub wait_s: f64,
    /// Largest lead of one worker's clock over another's at any hand-in.
    pub max_lead: u64,
    /// Events processed.
    pub events: u64,
    /// Value checks that passed.
    pub checks: u64,
    /// Landing slots of one worker held at one server at once, at most.
    pub max_slots_held: u32,
    /// Bytes in flight from one worker at once, at most.
    pub max_bytes_in_flight: usize,
}

#[derive(Debug, Clone)]
enum Ev {
    /// The worker's compute timer: exactly one is pending per running worker.
    Step(u32),
    /// Something the worker may be blocked on changed.
    Wake(u32),
    Init {
        server: u32,
        from: u32,
        chunk: u32,
        data: Vec<f32>,
    },
    Landed {
        server: u32,
        worker: u32,
        slot: u32,
        slice: u32,
        data: Vec<f32>,
    },
    PushDone {
        worker: u32,
        slice: u32,
    },
    Factors {
        to: u32,
        from: u32,
        layer: u32,
        iter: u64,
    },
    FactorsSent {
        worker: u32,
        layer: u32,
        peer: u32,
    },
    Credit {
        worker: u32,
        server: u32,
        slot: u32,
    },
    Params {
        worker: u32,
        chunk: u32,
        data: Vec<f32>,
    },
    BcastDone {
        server: u32,
        chunk: u32,
        worker: u32,
    },
    Applied {
        worker: u32,
        layer: u32,
        iter: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    Fwd(u32),
    Bwd(u32),
    Done,
}

/// (U, V) of one worker's layer.
type Factors = (Vec<f32>, Vec<f32>);

#[derive(Debug)]
struct WNode {
    core: Worker,
    phase: Phase,
    iter: u64,
    waiting: Option<(u32, u64)>,
    deferred: Vec<u32>,
    slow: f64,
    params: Vec<Vec<f32>>,
    factors: HashMap<(u32, u64, u32), Factors>,
    wait_ns: u64,
    finished: Option<u64>,
}

#[derive(Debug)]
struct SNode {
    core: Server,
    busy: u64,
    shard: Vec<f32>,
    acc: Vec<Vec<f32>>,
    slots: HashMap<(u32, u32), (u32, Vec<f32>)>,
}

/// The simulator.
#[derive(Debug)]
pub struct Sim {
    cfg: SimConfig,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64, usize)>>,
    evs: Vec<Option<Ev>>,
    /// Indices of `evs` that ran and can be reused.
    free_evs: Vec<usize>,
    workers: HashMap<u32, WNode>,
    servers: HashMap<u32, SNode>,
    net: Net<Vec<(u64, Ev)>>,
    net_out: Vec<(u64, Vec<(u64, Ev)>)>,
    rng: u64,
    report: SimReport,
    start: Option<u64>,
    last_progress: u64,
}

/// Transfers this small or smaller skip the NIC queues (credits, acks).
pub const CONTROL_BYTES: usize = 256;

/// Gradient element `i` of `layer` from worker index `w` in iteration `t`:
/// small integers plus a worker-specific quarter, so every sum is exact in f32
/// and a lost or doubled contribution changes it.
pub fn grad_value(w: usize, t: u64, layer: u32, i: usize) -> f32 {
    ((w * 7 + t as usize * 3 + layer as usize * 5 + i) % 5) as f32 + 0.25 * (w as f32 + 1.0)
}

/// Initial value of element `i` of `layer`.
pub fn init_value(layer: u32, i: usize) -> f32 {
    ((layer as usize + i) % 3) as f32
}

/// Factor element: small integers.
pub fn factor_value(w: usize, t: u64, which: u32, i: usize) -> f32 {
    ((w + t as usize + which as usize * 2 + i) % 3) as f32
}

impl Sim {
    /// Runs a simulation to the end.
    pub fn run(cfg: SimConfig) -> Result<SimReport, String> {
        let seed = cfg.seed;
        let mut sim = Sim::new(cfg).map_err(|e| format!("seed {seed}: {e}"))?;
        sim.go().map_err(|e| format!("seed {seed}: {e}"))?;
        Ok(sim.report)
    }

    fn new(cfg: SimConfig) -> Result<Self, String> {
        let book = cfg.book.clone();
        if cfg.layer_ns.len() != book.layers().len() {
            return Err(format!(
                "{} layer times for {} layers",
                cfg.layer_ns.len(),
                book.layers().len()
            ));
        }
        let world = book.cluster().world();
        let mut workers = HashMap::new();
        let mut servers = HashMap::new();
        for &r in book.cluster().workers() {
            let slow = cfg.faults.stragglers.iter().find(|(w, _)| *w == r).map_or(1.0, |s| s.1);
            let params = if cfg.values {
                book.layers()
                    .iter()
                    .enumerate()
                    .map(|(l, s)| (0..s.params()).map(|i| init_value(l as u32, i)).collect())
                    .collect()
            } else {
                Vec::new()
            };
            workers.insert(
                r,
                WNode {
                    core: Worker::new(book.clone(), r, cfg.sched).map_err(|e| e.to_string())?,
                    phase: Phase::Fwd(0),
                    iter: 0,
                    waiting: None,
                    deferred: Vec::new(),
                    slow,
                    params,
                    factors: HashMap::new(),
                    wait_ns: 0,
                    finished: None,
                },
            );
        }
        for &r in book.cluster().servers() {
            let core = Server::new(book.clone(), r, cfg.sched).map_err(|e| e.to_string())?;
            let n = if cfg.values { book.shard_len(r) } else { 0 };
            servers.insert(
                r,
                SNode {
                    acc: vec![vec![0.0; n]; core.windows()],
                    core,
                    busy: 0,
                    shard: vec![0.0; n],
                    slots: HashMap::new(),
                },
            );
        }
        let net = Net::new(world, cfg.bandwidth_bps, cfg.latency_ns);
        Ok(Sim {
            rng: cfg.seed ^ 0x9e37_79b9_7f4a_7c15,
            cfg,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            evs: Vec::new(),
            free_evs: Vec::new(),
            workers,
            servers,
            net,
            net_out: Vec::new(),
            report: SimReport::default(),
            start: None,
            last_progress: 0,
        })
    }

    fn rand(&mut self) -> u64 {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        let idx = match self.free_evs.pop() {
            Some(i) => {
                self.evs[i] = Some(ev);
                i
            }
            None => {
                self.evs.push(Some(ev));
                self.evs.len() - 1
            }
        };
        self.queue.push(Reverse((t, self.seq, idx)));
    }

    fn dead(&self, rank: u32, t: u64) -> bool {
        matches!(self.cfg.faults.dead, Some((r, at)) if r == rank && t >= at)
    }

    /// Sends `bytes` from `from` to `to`, handed to the NIC at `t` (now or
    /// later). Each `(delay, event)` of `on_arrival` runs `delay` after the
    /// message arrives; `on_sent` runs when its last byte has left `from`.
    /// Returns false when a dead end drops it.
    fn send(
        &mut self,
        from: u32,
        to: u32,
        bytes: usize,
        t: u64,
        on_arrival: Vec<(u64, Ev)>,
        on_sent: Option<Ev>,
    ) -> bool {
        if self.dead(from, t) || self.dead(to, t) {
            return false;
        }
        // A rank's own traffic does not touch the network. Control messages
        // interleave with bulk data at packet granularity on a real link, so
        // they pay latency only, not the queue ahead of them.
        let direct = if from == to {
            Some(t)
        } else if bytes <= CONTROL_BYTES {
            Some(t + self.cfg.latency_ns)
        } else {
            None
        };
        if let Some(at) = direct {
            if let Some(ev) = on_sent {
                self.at(t, ev);
            }
            for (d, ev) in on_arrival {
                self.at(at + d, ev);
            }
            return true;
        }
        let mut t = t;
        if let Some((side, a, b)) = &self.cfg.faults.partition {
            if t >= *a && t < *b && side.contains(&from) != side.contains(&to) {
                t = *b;
            }
        }
        let mut extra = 0;
        if self.cfg.faults.delay_prob > 0.0 && self.cfg.faults.delay_max_ns > 0 {
            let p = (self.rand() >> 11) as f64 / (1u64 << 53) as f64;
            if p < self.cfg.faults.delay_prob {
                extra = self.rand() % self.cfg.faults.delay_max_ns;
            }
        }
        let sent = on_sent.map(|ev| vec![(0, ev)]);
        self.net.send(t, from, to, bytes, on_arrival, sent, extra);
        true
    }

    /// What completes a write from `writer` that landed at `at`: an
    /// acknowledgement one latency after it lands. Both transports send it
    /// apart from bulk data (RDMA's NIC acknowledgements; the TCP backend's
    /// control socket), so it does not wait behind the data on its connection.
    fn ack(&self, at: u32, writer: u32, then: Ev) -> (u64, Ev) {
        if at == writer {
            (0, then)
        } else {
            (self.cfg.latency_ns, then)
        }
    }

    fn go(&mut self) -> Result<(), String> {
        // Rank 0's initial parameters go to the servers first.
        let ranks: Vec<u32> = self.cfg.book.cluster().workers().to_vec();
        for &r in &ranks {
            self.drain_worker(r)?;
            self.at(0, Ev::Step(r));
        }
        let max_events = 200_000_000u64;
        loop {
            // The network's timers run before the cluster's events of the same time.
            let next_ev = self.queue.peek().map(|Reverse((t, _, _))| *t);
            if let Some(tn) = self.net.next_time() {
                if next_ev.map_or(true, |te| tn <= te) {
                    if tn.saturating_sub(self.last_progress) > self.cfg.stall_ns {
                        break;
                    }
                    self.now = tn;
                    let mut out = std::mem::take(&mut self.net_out);
                    self.net.advance(tn, &mut out);
                    for (at, evs) in out.drain(..) {
                        for (d, ev) in evs {
                            self.at(at + d, ev);
                        }
                    }
                    self.net_out = out;
                    continue;
                }
            }
            let Some(Reverse((t, _, idx))) = self.queue.pop() else {
                break;
            };
            if t.saturating_sub(self.last_progress) > self.cfg.stall_ns {
                break;
            }
            self.now = t;
            self.report.events += 1;
            if self.report.events > max_events {
                return Err("event budget exhausted".into());
            }
            let ev = self.evs[idx].take().expect("each event runs once");
            self.free_evs.push(idx);
            self.handle(ev)?;
            if self.workers.values().all(|w| w.finished.is_some()) {
                break;
            }
        }
        let stuck: Vec<String> = self
            .workers
            .iter()
            .filter(|(_, w)| w.finished.is_none())
            .map(|(r, w)| format!("rank {r} in iteration {} {:?}", w.iter, w.phase))
            .collect();
        if !stuck.is_empty() {
            return Err(format!(
                "no progress for {} ms of virtual time (a liveness timeout): {}",
                self.cfg.stall_ns / 1_000_000,
                stuck.join(", ")
            ));
        }
        let end = self.workers.values().filter_map(|w| w.finished).max().unwrap_or(0);
        let start = self.start.unwrap_or(0);
        self.report.total_ns = end - start;
        self.report.iteration_s = self.report.total_ns as f64 / 1e9 / self.cfg.iters.max(1) as f64;
        let n = self.workers.len() as f64 * self.cfg.iters.max(1) as f64;
        self.report.wait_s = self.workers.values().map(|w| w.wait_ns as f64).sum::<f64>() / 1e9 / n;
        for s in self.servers.values() {
            self.report.max_slots_held = self.report.max_slots_held.max(s.core.stats().max_slots_held);
        }
        for w in self.workers.values() {
            self.report.max_bytes_in_flight = self.report.max_bytes_in_flight.max(w.core.stats().max_bytes_in_flight);
        }
        Ok(())
    }

    fn handle(&mut self, ev: Ev) -> Result<(), String> {
        let e = |x: crate::EngineError| x.to_string();
        match ev {
            Ev::Step(r) => self.step(r)?,
            Ev::Wake(r) => {
                let w = &self.workers[&r];
                if w.waiting.is_some() || w.phase == Phase::Done {
                    self.step(r)?;
                }
            }
            Ev::Init {
                server,
                from,
                chunk,
                data,
            } => {
                if self.cfg.values {
                    let ch = self.cfg.book.chunks()[chunk as usize];
                    let s = self.servers.get_mut(&server).expect("server");
                    s.shard[ch.shard_offset..ch.shard_offset + ch.len].copy_from_slice(&data);
                }
                self.servers
                    .get_mut(&server)
                    .expect("server")
                    .core
                    .handle_init(from, chunk)
                    .map_err(e)?;
                self.drain_server(server)?;
            }
            Ev::Landed {
                server,
                worker,
                slot,
                slice,
                data,
            } => {
                let s = self.servers.get_mut(&server).expect("server");
                if s.slots.insert((worker, slot), (slice, data)).is_some() {
                    return Err(format!(
                        "worker {worker} wrote into slot {slot} at server {server} while it was full"
                    ));
                }
                let held = s.slots.keys().filter(|(w, _)| *w == worker).count();
                if held > self.cfg.sched.slots as usize {
                    return Err(format!(
                        "credits exceeded: {held} slots of worker {worker} held at server {server}"
                    ));
                }
                s.core.handle_landed(worker, slot, slice).map_err(e)?;
                self.drain_server(server)?;
            }
            Ev::PushDone { worker, slice } => {
                self.workers
                    .get_mut(&worker)
                    .expect("worker")
                    .core
                    .handle_push_done(slice)
                    .map_err(e)?;
                self.drain_worker(worker)?;
            }
            Ev::Factors { to, from, layer, iter } => {
                if self.cfg.values {
                    let f = self.factors_of(from, layer, iter);
                    self.workers
                        .get_mut(&to)
                        .expect("worker")
                        .factors
                        .insert((layer, iter, from), f);
                }
                self.workers
                    .get_mut(&to)
                    .expect("worker")
                    .core
                    .handle_factors_arrived(layer, iter, from)
                    .map_err(e)?;
                self.drain_worker(to)?;
            }
            Ev::FactorsSent { worker, layer, peer } => {
                self.workers
                    .get_mut(&worker)
                    .expect("worker")
                    .core
                    .handle_factors_sent(layer, peer)
                    .map_err(e)?;
                self.drain_worker(worker)?;
            }
            Ev::Credit { worker, server, slot } => {
                self.workers
                    .get_mut(&worker)
                    .expect("worker")
                    .core
                    .handle_credit(server, slot)
                    .map_err(e)?;
                self.drain_worker(worker)?;
            }
            Ev::Params { worker, chunk, data } => {
                if self.cfg.values {
                    let ch = self.cfg.book.chunks()[chunk as usize];
                    let w = self.workers.get_mut(&worker).expect("worker");
                    w.params[ch.layer as usize][ch.offset..ch.offset + ch.len].copy_from_slice(&data);
                }
                let w = self.workers.get_mut(&worker).expect("worker");
                w.core.handle_params(chunk).map_err(e)?;
                if w.waiting.is_some() && w.core.is_initialized() {
                    self.at(self.now, Ev::Wake(worker));
                }
                self.drain_worker(worker)?;
            }
            Ev::BcastDone { server, chunk, worker } => {
                self.servers
                    .get_mut(&server)
                    .expect("server")
                    .core
                    .handle_broadcast_done(chunk, worker)
                    .map_err(e)?;
                self.drain_server(server)?;
            }
            Ev::Applied { worker, layer, iter } => {
                if self.cfg.values {
                    self.reconstruct(worker, layer, iter);
                }
                self.workers
                    .get_mut(&worker)
                    .expect("worker")
                    .core
                    .handle_factors_applied(layer, iter)
                    .map_err(e)?;
                self.drain_worker(worker)?;
            }
        }
        Ok(())
    }

    fn factors_of(&self, from: u32, layer: u32, iter: u64) -> (Vec<f32>, Vec<f32>) {
        let wi = self.cfg.book.cluster().worker_index(from).expect("worker");
        let l = &self.cfg.book.layers()[layer as usize];
        let k = self.cfg.book.config().batch;
        (
            (0..k * l.m).map(|i| factor_value(wi, iter, 0, i)).collect(),
            (0..k * l.n).map(|i| factor_value(wi, iter, 1, i)).collect(),
        )
    }

    /// Σ_p U_pᵀV_p in worker order, applied with the Sum op.
    fn reconstruct(&mut self, worker: u32, layer: u32, iter: u64) {
        let book = self.cfg.book.clone();
        let l = &book.layers()[layer as usize];
        let k = book.config().batch;
        let w = self.workers.get_mut(&worker).expect("worker");
        let mut out = vec![0f32; l.m * l.n];
        for &p in book.cluster().workers() {
            let (u, v) = w.factors.remove(&(layer, iter, p)).expect("all factors arrived");
            for i in 0..l.m {
                for j in 0..l.n {
                    out[i * l.n + j] += (0..k).map(|kk| u[kk * l.m + i] * v[kk * l.n + j]).sum::<f32>();
                }
            }
        }
        w.params[layer as usize] = out;
    }

    fn step(&mut self, r: u32) -> Result<(), String> {
        let now = self.now;
        if self.dead(r, now) {
            return Ok(());
        }
        let iters = self.cfg.iters;
        let nl = self.cfg.book.layers().len() as u32;
        let w = self.workers.get_mut(&r).expect("worker");
        match w.phase {
            Phase::Fwd(l) => {
                if w.core.is_in_flight(l) || !w.core.is_initialized() {
                    if w.waiting.is_none() {
                        w.waiting = Some((l, now));
                    }
                    return Ok(());
                }
                if let Some((_, since)) = w.waiting.take() {
                    // Waiting for the initial parameters is not training time.
                    if w.iter > 0 || l > 0 {
                        w.wait_ns += now - since;
                    }
                }
                if l == 0 && w.iter == 0 && self.start.is_none() {
                    self.start = Some(now);
                }
                // The step after the last forward fires when the last layer's backward ends.
                let mut dt = (self.cfg.layer_ns[l as usize].0 as f64 * w.slow) as u64;
                if l + 1 == nl {
                    dt += (self.cfg.layer_ns[l as usize].1 as f64 * w.slow) as u64;
                }
                w.phase = if l + 1 < nl {
                    Phase::Fwd(l + 1)
                } else {
                    Phase::Bwd(nl - 1)
                };
                self.at(now + dt, Ev::Step(r));
            }
            Phase::Bwd(l) => {
                // The backward of l is done: hand it in (WFBP) or defer it.
                if self.cfg.wait_free {
                    self.hand_in(r, l)?;
                } else {
                    self.workers.get_mut(&r).expect("worker").deferred.push(l);
                }
                let w = self.workers.get_mut(&r).expect("worker");
                if l > 0 {
                    w.phase = Phase::Bwd(l - 1);
                    let dt = (self.cfg.layer_ns[l as usize - 1].1 as f64 * w.slow) as u64;
                    self.at(now + dt, Ev::Step(r));
                } else {
                    let deferred = std::mem::take(&mut w.deferred);
                    for d in deferred {
                        self.hand_in(r, d)?;
                    }
                    let w = self.workers.get_mut(&r).expect("worker");
                    w.iter += 1;
                    w.phase = if w.iter == iters { Phase::Done } else { Phase::Fwd(0) };
                    self.at(now, Ev::Step(r));
                }
            }
            Phase::Done => {
                if w.finished.is_none() && (0..nl).all(|l| !w.core.is_in_flight(l)) {
                    w.finished = Some(now);
                }
            }
        }
        Ok(())
    }

    fn hand_in(&mut self, r: u32, l: u32) -> Result<(), String> {
        let lead = {
            let clocks: Vec<u64> = self.workers.values().map(|w| w.iter).collect();
            clocks.iter().max().unwrap_or(&0) - clocks.iter().min().unwrap_or(&0)
        };
        self.report.max_lead = self.report.max_lead.max(lead);
        let w = self.workers.get_mut(&r).expect("worker");
        let scheme = w.core.next_scheme(l).map_err(|e| e.to_string())?;
        if scheme == Scheme::Sfb {
            w.core.sf_ready(l).map_err(|e| e.to_string())?;
        } else {
            w.core.grad_ready(l).map_err(|e| e.to_string())?;
        }
        self.drain_worker(r)
    }

    fn drain_worker(&mut self, r: u32) -> Result<(), String> {
        let now = self.now;
        let book = self.cfg.book.clone();
        let wi = book.cluster().worker_index(r).expect("worker");
        while let Some(cmd) = self.workers.get_mut(&r).expect("worker").core.poll_command() {
            self.last_progress = now;
            match cmd {
                WorkerCommand::InitPush { server, chunk } => {
                    let ch = book.chunks()[chunk as usize];
                    let data = if self.cfg.values {
                        self.workers[&r].params[ch.layer as usize][ch.offset..ch.offset + ch.len].to_vec()
                    } else {
                        Vec::new()
                    };
                    let init = Ev::Init {
                        server,
                        from: r,
                        chunk,
                        data,
                    };
                    self.send(r, server, ch.len * 4, now, vec![(0, init)], None);
                }
                WorkerCommand::Push {
                    server,
                    slot,
                    slice,
                    iter,
                } => {
                    let s = book.slices()[slice as usize];
                    let data = if self.cfg.values {
                        (s.offset..s.offset + s.len)
                            .map(|i| grad_value(wi, iter, s.layer, i))
                            .collect()
                    } else {
                        Vec::new()
                    };
                    let landed = Ev::Landed {
                        server,
                        worker: r,
                        slot,
                        slice,
                        data,
                    };
                    let done = self.ack(server, r, Ev::PushDone { worker: r, slice });
                    self.send(r, server, s.len * 4, now, vec![(0, landed), done], None);
                }
                WorkerCommand::SendFactors { peer, layer, iter } => {
                    let l = &book.layers()[layer as usize];
                    let bytes = book.config().batch * (l.m + l.n) * 4;
                    let factors = Ev::Factors {
                        to: peer,
                        from: r,
                        layer,
                        iter,
                    };
                    let sent = Ev::FactorsSent { worker: r, layer, peer };
                    self.send(r, peer, bytes, now, vec![(0, factors)], Some(sent));
                }
                WorkerCommand::Reconstruct { layer, iter } => {
                    if self.cfg.values {
                        let f = self.factors_of(r, layer, iter);
                        self.workers
                            .get_mut(&r)
                            .expect("worker")
                            .factors
                            .insert((layer, iter, r), f);
                    }
                    let l = &book.layers()[layer as usize];
                    let flops = 2.0 * (book.config().batch * l.m * l.n * book.p1()) as f64;
                    let dt = (flops / self.cfg.gemm_flops * 1e9) as u64;
                    self.at(now + dt, Ev::Applied { worker: r, layer, iter });
                }
                WorkerCommand::LayerReady { layer, iter } => {
                    if self.cfg.values {
                        self.check_layer(r, layer, iter)?;
                    }
                    let w = self.workers.get_mut(&r).expect("worker");
                    if matches!(w.waiting, Some((l, _)) if l == layer) || w.phase == Phase::Done {
                        self.at(now, Ev::Wake(r));
                    }
                }
            }
        }
        Ok(())
    }

    /// Under BSP the layer now holds exactly Σ_w grad(w, iter) (or the SFB sum).
    fn check_layer(&mut self, r: u32, layer: u32, iter: u64) -> Result<(), String> {
        if self.cfg.sched.consistency != Consistency::Bsp {
            return Ok(());
        }
        let book = self.cfg.book.clone();
        let l = &book.layers()[layer as usize];
        let w = &self.workers[&r];
        let got = &w.params[layer as usize];
        let p1 = book.p1();
        let scheme = book.scheme(layer, iter);
        for (i, g) in got.iter().enumerate().take(l.params()) {
            let want: f64 = match scheme {
                Scheme::Ps => (0..p1).map(|wi| grad_value(wi, iter, layer, i) as f64).sum(),
                Scheme::Sfb => {
                    let k = book.config().batch;
                    let (row, col) = (i / l.n, i % l.n);
                    (0..p1)
                        .map(|wi| {
                            (0..k)
                                .map(|kk| {
                                    factor_value(wi, iter, 0, kk * l.m + row) as f64
                                        * factor_value(wi, iter, 1, kk * l.n + col) as f64
                                })
                                .sum::<f64>()
                        })
                        .sum()
                }
            };
            if *g as f64 != want {
                return Err(format!(
                    "rank {r} layer {layer} element {i} after iteration {iter}: {g} != {want} (lost or doubled contribution)"
                ));
            }
        }
        // Every other worker that finished this iteration holds the same bits.
        for (&o, ow) in &self.workers {
            if o != r && ow.core.completed(layer) == iter + 1 && !ow.core.is_in_flight(layer) {
                let same = ow.params[layer as usize]
                    .iter()
                    .zip(got)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                if !same {
                    return Err(format!(
                        "ranks {r} and {o} differ on layer {layer} after iteration {iter}"
                    ));
                }
            }
        }
        self.report.checks += 1;
        Ok(())
    }

    fn drain_server(&mut self, r: u32) -> Result<(), String> {
        let book = self.cfg.book.clone();
        let values = self.cfg.values;
        let mut t = self.now.max(self.servers[&r].busy);
        while let Some(cmd) = self.servers.get_mut(&r).expect("server").core.poll_command() {
            self.last_progress = self.now;
            match cmd {
                ServerCommand::Accumulate {
                    worker,
                    slot,
                    slice,
                    window,
                    first,
                } => {
                    let s = self.servers.get_mut(&r).expect("server");
                    let (landed, data) = s.slots.remove(&(worker, slot)).ok_or("accumulate from an empty slot")?;
                    if landed != slice {
                        return Err(format!(
                            "slot {slot} of worker {worker} holds slice {landed}, not {slice}"
                        ));
                    }
                    let si = book.slices()[slice as usize];
                    t += (si.len as f64 * 4.0 / self.cfg.agg_bytes_per_s * 1e9) as u64;
                    if values {
                        let ch = book.chunks()[si.chunk as usize];
                        let at = ch.shard_offset + (si.offset - ch.offset);
                        let acc = &mut s.acc[window as usize][at..at + si.len];
                        if first {
                            acc.copy_from_slice(&data);
                        } else {
                            for (a, d) in acc.iter_mut().zip(&data) {
                                *a += *d;
                            }
                        }
                    }
                }
                ServerCommand::ReturnCredit { worker, slot } => {
                    let credit = Ev::Credit {
                        worker,
                        server: r,
                        slot,
                    };
                    self.send(r, worker, 16, t, vec![(0, credit)], None);
                }
                ServerCommand::Apply { chunk, window, .. } => {
                    let ch = book.chunks()[chunk as usize];
                    t += (ch.len as f64 * 8.0 / self.cfg.agg_bytes_per_s * 1e9) as u64;
                    if values {
                        let s = self.servers.get_mut(&r).expect("server");
                        let range = ch.shard_offset..ch.shard_offset + ch.len;
                        let acc = s.acc[window as usize][range.clone()].to_vec();
                        s.shard[range].copy_from_slice(&acc);
                    }
                }
                ServerCommand::Broadcast { chunk, worker } => {
                    let ch = book.chunks()[chunk as usize];
                    let data = if values {
                        self.servers[&r].shard[ch.shard_offset..ch.shard_offset + ch.len].to_vec()
                    } else {
                        Vec::new()
                    };
                    let params = Ev::Params { worker, chunk, data };
                    let done = self.ack(
                        worker,
                        r,
                        Ev::BcastDone {
                            server: r,
                            chunk,
                            worker,
                        },
                    );
                    self.send(r, worker, ch.len * 4, t, vec![(0, params), done], None);
                }
            }
        }
        self.servers.get_mut(&r).expect("server").busy = t;
        Ok(())
    }
}

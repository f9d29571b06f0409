//! The event loop: virtual time, the event queue, the ranks, the network,
//! and the end of a run (its report and the final checks).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use tidewire_engine::error::EngineError;
use tidewire_engine::node::{Input, Job, JobKind, Loc, LocalRegion, Output, Payload, TxOp};
use tidewire_engine::sparse::SparseLayerStats;
use tidewire_engine::wire::Kind;

use crate::config::{SimConfig, SimError};
use crate::exec::{f32s, ridx};
use crate::net::Net;
use crate::oracle::Oracle;
use crate::rank::{make_rank, Phase, Rank, WLoop};
use crate::report::SimReport;

#[derive(Debug, Clone)]
pub(crate) enum Ev {
    /// The worker's compute timer: exactly one is pending per running worker.
    Step(u32),
    /// Something the worker may be blocked on changed.
    Wake(u32),
    /// The rank's driver offers its held transmits to the transport again.
    Retry(u32),
    /// An input for a rank's Node.
    Input(u32, Input),
    /// A write's bytes arrive at `to`.
    WriteArrive {
        from: u32,
        to: u32,
        token: u64,
        src: Loc,
        dst: Loc,
        len: u64,
        imm: Option<u32>,
    },
    /// A message arrives at `to`.
    MsgArrive {
        from: u32,
        to: u32,
        tag: u32,
        data: Payload,
    },
    /// A send left `from`.
    Sent { from: u32, token: u64 },
    /// A job finished on its executor.
    JobDone(u32, Job),
    /// With the host's cores shared: rank's executor `q` finishes its job,
    /// if `gen` is still its current schedule ([`crate::cpu`]).
    CpuDone(u32, usize, u64),
    /// The crash fault strikes a worker at an iteration boundary.
    Crash(u32),
    /// The crashed worker comes back.
    Rejoin(u32),
    /// A rank that left closes its connection to `to` gracefully: after
    /// everything it sent on it, like TCP's FIN.
    Fin { from: u32, to: u32 },
    /// The dead fault strikes.
    Kill(u32),
}

/// The simulator.
#[derive(Debug)]
pub struct Sim {
    pub(crate) cfg: SimConfig,
    pub(crate) now: u64,
    pub(crate) seq: u64,
    pub(crate) queue: BinaryHeap<Reverse<(u64, u64, usize)>>,
    pub(crate) evs: Vec<Option<Ev>>,
    pub(crate) free_evs: Vec<usize>,
    pub(crate) ranks: Vec<Rank>,
    pub(crate) net: Net<Ev>,
    pub(crate) net_out: Vec<(u64, Ev)>,
    /// Per (from, to, class: 0 writes, 1 messages): last arrival time, at
    /// `(from × world + to) × 2 + class`.
    pub(crate) order: Vec<u64>,
    /// Per (from, to): messages in the network, at `from × world + to`.
    pub(crate) msgs_in_net: Vec<usize>,
    pub(crate) rng: u64,
    pub(crate) report: SimReport,
    pub(crate) start: Option<u64>,
    pub(crate) last_progress: u64,
    /// `TIDEWIRE_SIM_TRACE=1`: every input and output on stderr.
    pub(crate) trace: bool,
    /// Ranks done, failed or dead.
    pub(crate) settled: usize,
    /// Graceful closes still in the network (the last ones outlive the run).
    pub(crate) fins_in_net: usize,
    /// Accumulate jobs emitted, every server together.
    pub(crate) accumulates: u64,
    /// The crash fault struck (once), at this iteration.
    pub(crate) crashed_at: Option<u64>,
    /// Pushes of worker processes that were replaced (a crash and a rejoin).
    pub(crate) retired_pushes: u64,
    /// Sends that left at once (control messages on an idle connection):
    /// their completions, fed after the drain that posted them.
    pub(crate) sent_now: Vec<(u32, u64)>,
    /// The checker's oracle of the values under the mean and SGD.
    pub(crate) oracle: Oracle,
    /// The schemes by iteration: the book's, and worker 0's decisions as the
    /// driver made them (what the checks expect).
    pub(crate) plan: tidewire_engine::Plan,
    /// Worker 0's policy where the book is adaptive and no seed draws the decisions.
    pub(crate) adapt: Option<tidewire_engine::adapt::Adapt>,
}

pub(crate) fn brief_input(i: &Input) -> String {
    match i {
        Input::Message { peer, tag, data } => format!("Message from {peer} tag {tag:#x} ({} bytes)", data.len()),
        Input::JobDone { id, data } => format!("JobDone {id} ({} bytes)", data.as_ref().map_or(0, Vec::len)),
        other => format!("{other:?}"),
    }
}

pub(crate) fn brief_output(o: &Output) -> String {
    match o {
        Output::Transmit(t) => match &t.op {
            TxOp::Send { tag, src } => format!("Send#{} to {} tag {tag:#x} ({} bytes)", t.token, t.peer, src.len()),
            op => format!("Transmit#{} to {}: {op:?}", t.token, t.peer),
        },
        Output::Job(j) => match &j.kind {
            JobKind::Reconstruct { layer, iter, .. } => format!("Job {} Reconstruct layer {layer} iter {iter}", j.id),
            JobKind::SumFactors { layer, iter, .. } => format!("Job {} SumFactors layer {layer} iter {iter}", j.id),
            k => format!("Job {} {k:?}", j.id),
        },
        other => format!("{other:?}"),
    }
}

const EVENT_BUDGET: u64 = 400_000_000;

impl Sim {
    /// Runs a simulation to the end.
    pub fn run(cfg: SimConfig) -> Result<SimReport, SimError> {
        let mut sim = Sim::new(cfg)?;
        sim.go()?;
        Ok(sim.report)
    }

    fn new(mut cfg: SimConfig) -> Result<Self, SimError> {
        cfg.sched = cfg.sched.resolve(&cfg.book);
        let seed = cfg.seed;
        let config = |error| SimError::Config { seed, error };
        let book = cfg.book.clone();
        if cfg.layer_ns.len() != book.layers().len() {
            return Err(config(EngineError::InvalidConfig(format!(
                "{} layer times for {} layers",
                cfg.layer_ns.len(),
                book.layers().len()
            ))));
        }
        let world = book.cluster().world();
        let mut ranks = Vec::with_capacity(world);
        for r in 0..world as u32 {
            ranks.push(make_rank(&cfg, r)?);
        }
        let hosts = match &cfg.hosts {
            Some(h) if h.len() == world => h.clone(),
            Some(h) => {
                return Err(SimError::Config {
                    seed: cfg.seed,
                    error: EngineError::InvalidConfig(format!("{} hosts given for {world} ranks", h.len())),
                })
            }
            None => (0..world as u32).collect(),
        };
        if cfg.local_learners == 0 || cfg.local_bytes_per_s.is_nan() || cfg.local_bytes_per_s <= 0.0 {
            return Err(SimError::Config {
                seed: cfg.seed,
                error: EngineError::InvalidConfig("local_learners ≥ 1 and local_bytes_per_s > 0".into()),
            });
        }
        let mut net = Net::with_hosts(hosts, cfg.bandwidth_bps, cfg.latency_ns, cfg.local_bytes_per_s);
        if let Some(bin) = cfg.trace_bin_ns {
            net.trace(bin);
        }
        if let Some((cores, stream)) = cfg.host_cpu {
            if !(cores > 0.0 && stream > 0.0 && cores.is_finite() && stream.is_finite()) {
                return Err(SimError::Config {
                    seed: cfg.seed,
                    error: EngineError::InvalidConfig(format!("host_cpu: {cores} cores, {stream} B/s")),
                });
            }
            net.host_cpu(cores, stream);
        }
        Ok(Sim {
            rng: cfg.seed ^ 0x9e37_79b9_7f4a_7c15,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            evs: Vec::new(),
            free_evs: Vec::new(),
            ranks,
            net,
            net_out: Vec::new(),
            order: vec![0; world * world * 2],
            msgs_in_net: vec![0; world * world],
            report: SimReport::default(),
            start: None,
            last_progress: 0,
            trace: std::env::var_os("TIDEWIRE_SIM_TRACE").is_some(),
            settled: 0,
            fins_in_net: 0,
            accumulates: 0,
            crashed_at: None,
            retired_pushes: 0,
            sent_now: Vec::new(),
            oracle: Oracle::default(),
            plan: cfg.book.plan().clone(),
            adapt: if cfg.decide_seed.is_none() {
                tidewire_engine::adapt::Adapt::new(&cfg.book)
            } else {
                None
            },
            cfg,
        })
    }

    pub(crate) fn rand(&mut self) -> u64 {
        tidewire_engine::testkit::next(&mut self.rng)
    }

    pub(crate) fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.rand() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    pub(crate) fn at(&mut self, t: u64, ev: Ev) {
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

    pub(crate) fn violation(&self, what: String) -> SimError {
        SimError::Violation {
            seed: self.cfg.seed,
            at_ns: self.now,
            what,
        }
    }

    fn go(&mut self) -> Result<(), SimError> {
        let world = self.ranks.len() as u32;
        if let Some((r, t)) = self.cfg.faults.dead {
            if r < world {
                self.at(t, Ev::Kill(r));
            }
        }
        if let Some((r, _)) = self.cfg.faults.crash {
            if self.cfg.book.cluster().worker_index(r).is_none() {
                return Err(SimError::Config {
                    seed: self.cfg.seed,
                    error: EngineError::InvalidConfig(format!("the crash fault names rank {r}, which is not a worker")),
                });
            }
        }
        for r in 0..world {
            for p in (0..world).filter(|&p| p != r) {
                self.at(0, Ev::Input(r, Input::Connected { peer: p }));
            }
            if self.ranks[r as usize].worker.is_some() {
                self.at(0, Ev::Step(r));
            } else {
                self.at(0, Ev::Input(r, Input::Shutdown));
            }
            // A rank alone has no connection to wait for.
            self.at(0, Ev::Input(r, Input::Tick));
        }
        loop {
            // The network's timers run before the cluster's events of the same time.
            let next_ev = self.queue.peek().map(|Reverse((t, _, _))| *t);
            let next_net = self.net.next_time();
            let t = match (next_ev, next_net) {
                (None, None) => break,
                (Some(a), Some(b)) => a.min(b),
                (a, b) => a.or(b).expect("one is set"),
            };
            if t.saturating_sub(self.last_progress) > self.cfg.stall_ns {
                break;
            }
            if self.all_settled() {
                break;
            }
            self.now = t;
            if next_net == Some(t) {
                let mut out = std::mem::take(&mut self.net_out);
                self.net.advance(t, &mut out);
                for (at, ev) in out.drain(..) {
                    self.arrival(at, ev, true);
                }
                self.net_out = out;
                // Its loopback connections may have changed the cores' shares.
                self.cpu_refresh();
                continue;
            }
            let Some(Reverse((_, _, idx))) = self.queue.pop() else {
                break;
            };
            self.report.events += 1;
            if self.report.events > EVENT_BUDGET {
                return Err(self.violation("event budget exhausted (a livelock?)".into()));
            }
            let ev = self.evs[idx].take().expect("each event runs once");
            self.free_evs.push(idx);
            self.handle(ev)?;
        }
        self.finish()
    }

    /// Every rank is done, failed or dead.
    fn all_settled(&self) -> bool {
        self.settled == self.ranks.len()
    }

    /// Counts a rank that just became done, failed or dead (once).
    pub(crate) fn settle(&mut self, r: u32) {
        let rank = &self.ranks[r as usize];
        let n = usize::from(rank.dead) + usize::from(rank.fatal.is_some()) + usize::from(rank.finished.is_some());
        if n == 1 {
            self.settled += 1;
        }
    }

    /// The end of a run: the earliest failure if there is one, else the
    /// report and the final checks.
    fn finish(&mut self) -> Result<(), SimError> {
        self.failure()?;
        self.report_times();
        self.report_ranks();
        self.check_end()
    }

    /// A rank's typed failure (earliest first), a stall, or transfers left in
    /// the network after every rank left.
    fn failure(&self) -> Result<(), SimError> {
        let seed = self.cfg.seed;
        // A rank's typed failure, earliest first (a dead peer makes the others fail).
        if let Some((r, (at, e))) = self
            .ranks
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.fatal.clone().map(|f| (i, f)))
            .min_by_key(|(i, (at, _))| (*at, *i))
        {
            return Err(SimError::Rank {
                seed,
                rank: r as u32,
                at_ns: at,
                error: e,
            });
        }
        let stuck: Vec<String> = self
            .ranks
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.dead && r.finished.is_none())
            .map(|(i, r)| match &r.worker {
                Some(w) => format!("rank {i} in iteration {} {:?}", w.iter, w.phase),
                None => format!("rank {i} (server)"),
            })
            .collect();
        if !stuck.is_empty() {
            return Err(SimError::Stalled {
                seed,
                stall_ms: self.cfg.stall_ns / 1_000_000,
                stuck: stuck.join(", "),
            });
        }
        if self.net.in_flight() > self.fins_in_net {
            return Err(self.violation(format!(
                "{} transfers still in the network after every rank left",
                self.net.in_flight() - self.fins_in_net
            )));
        }
        Ok(())
    }

    /// The report's times: the run, its iterations, waits, local aggregation
    /// and fan-out, and the NICs' bytes.
    fn report_times(&mut self) {
        let end = self
            .ranks
            .iter()
            .filter_map(|r| r.worker.as_ref()?.finished)
            .max()
            .unwrap_or(0);
        let start = self.start.unwrap_or(0);
        self.report.total_ns = end.saturating_sub(start);
        self.report.goodbye_ns = self.ranks.iter().filter_map(|r| r.finished).max().unwrap_or(0);
        self.report.iteration_s = self.report.total_ns as f64 / 1e9 / self.cfg.iters.max(1) as f64;
        let workers: Vec<&WLoop> = self.ranks.iter().filter_map(|r| r.worker.as_ref()).collect();
        let n = workers.len() as f64 * self.cfg.iters.max(1) as f64;
        self.report.wait_s = workers.iter().map(|w| w.wait_ns as f64).sum::<f64>() / 1e9 / n;
        let local = |i: usize| self.ranks.iter().map(|r| r.local_ns[i] as f64).sum::<f64>() / 1e9 / n;
        self.report.local_agg_s = local(0);
        self.report.fanout_s = local(1);
        self.report.nic_bytes = (0..self.net.hosts()).map(|h| self.net.nic_bytes(h)).collect();
        self.report.start_ns = self.start.unwrap_or(0);
        if let Some((_, t)) = self.net.traced() {
            let bytes = |v: &[f64]| v.iter().map(|b| b.round() as u64).collect::<Vec<u64>>();
            self.report.nic_trace = t.iter().map(|[tx, rx]| [bytes(tx), bytes(rx)]).collect();
        }
    }

    /// The report's per-rank parts: iterations and finish times, the Nodes'
    /// counters, sparse pushes and (values mode) every worker's parameters.
    fn report_ranks(&mut self) {
        let start = self.start.unwrap_or(0);
        for r in &self.ranks {
            if let Some(w) = &r.worker {
                self.report.worker_iters.push(w.iter);
                self.report.worker_done_ns.push(if r.dead {
                    0
                } else {
                    w.finished.unwrap_or(0).saturating_sub(start)
                });
            }
            let s = r.node.stats();
            self.report.applies += s.applies;
            self.report.pulls += s.pulls;
            self.report.partial_applies += s.partial_applies;
            self.report.dropped += s.dropped;
            self.report.late_folded += s.late_folded;
            self.report.max_slots_held = self.report.max_slots_held.max(s.max_slots_held);
            self.report.landing_bytes = self.report.landing_bytes.max(r.node.region_bytes(LocalRegion::Landing));
            self.report.parked += s.parked;
            self.report.held_for_order += s.held_for_order;
            self.report.max_spares_used = self.report.max_spares_used.max(s.max_spares_used);
            self.report.max_bytes_in_flight = self.report.max_bytes_in_flight.max(s.max_bytes_in_flight);
            self.report.max_outstanding = self.report.max_outstanding.max(s.max_outstanding);
            self.report.max_message = self.report.max_message.max(s.max_message);
            self.report.max_write = self.report.max_write.max(s.max_write);
            self.report.max_factor_blocks = self.report.max_factor_blocks.max(s.max_factor_blocks);
            let st = r.node.sparse_stats();
            self.report.sparse.resize(st.len(), SparseLayerStats::default());
            for (a, b) in self.report.sparse.iter_mut().zip(st) {
                a.add(b);
            }
        }
        if self.cfg.values {
            self.report.params_bits = self
                .ranks
                .iter()
                .filter(|r| r.worker.is_some())
                .map(|r| {
                    f32s(&r.store.mem[ridx(LocalRegion::Params)])
                        .iter()
                        .map(|v| v.to_bits())
                        .collect()
                })
                .collect();
        }
    }

    pub(crate) fn dead(&self, rank: u32) -> bool {
        self.ranks[rank as usize].dead
    }

    fn handle(&mut self, ev: Ev) -> Result<(), SimError> {
        match ev {
            Ev::Step(r) => self.step(r)?,
            Ev::Wake(r) => {
                let w = self.ranks[r as usize].worker.as_ref().expect("worker");
                if w.waiting.is_some() || w.phase == Phase::Done {
                    self.step(r)?;
                }
            }
            Ev::Input(r, input) => self.feed(r, input)?,
            Ev::Retry(r) => self.retry_held(r)?,
            Ev::WriteArrive {
                from,
                to,
                token,
                src,
                dst,
                len,
                imm,
            } => self.on_write_arrive(from, to, token, (src, dst, len), imm)?,
            Ev::MsgArrive { from, to, tag, data } => {
                if !self.dead(to) && !self.dead(from) {
                    if let (true, Payload::Bytes(b)) = (tag == Kind::FactorData.tag(), &data) {
                        self.ranks[to as usize]
                            .store
                            .delivered
                            .insert((b.as_ptr() as usize, b.len()));
                    }
                    self.feed(to, Input::Message { peer: from, tag, data })?;
                }
            }
            Ev::Fin { from, to } => {
                if !self.dead(to) {
                    self.feed(
                        to,
                        Input::Closed {
                            peer: from,
                            error: None,
                        },
                    )?;
                }
            }
            Ev::Sent { from, token } => {
                if !self.dead(from) {
                    self.feed(from, Input::Done { token })?;
                }
            }
            Ev::CpuDone(r, q, gen) => self.cpu_done(r, q, gen)?,
            Ev::JobDone(r, job) => {
                if self.dead(r) {
                    return Ok(());
                }
                let done = self.ranks[r as usize].store.execute(&self.cfg, r, &job);
                let data = done.map_err(|what| self.violation(what))?;
                self.feed(r, Input::JobDone { id: job.id, data })?;
            }
            Ev::Crash(r) => self.on_crash(r)?,
            Ev::Rejoin(r) => self.rejoin(r)?,
            Ev::Kill(r) => self.on_kill(r),
        }
        Ok(())
    }

    /// A write's bytes arrive at `to`: placed (values mode), a notice with its
    /// immediate, and the writer's completion one latency later.
    fn on_write_arrive(
        &mut self,
        from: u32,
        to: u32,
        token: u64,
        (src, dst, len): (Loc, Loc, u64),
        imm: Option<u32>,
    ) -> Result<(), SimError> {
        if self.dead(to) || self.dead(from) {
            return Ok(());
        }
        if self.cfg.values {
            let data = self.ranks[from as usize].store.mem[ridx(src.region)]
                [src.offset as usize..(src.offset + len) as usize]
                .to_vec();
            let end = (dst.offset + len) as usize;
            let have = self.ranks[to as usize].store.mem[ridx(dst.region)].len();
            if end > have {
                return Err(self.violation(format!(
                    "rank {from} wrote {len} bytes at {} into rank {to}'s {:?} of {have} bytes",
                    dst.offset, dst.region
                )));
            }
            self.ranks[to as usize].store.mem[ridx(dst.region)][dst.offset as usize..end].copy_from_slice(&data);
        }
        if let Some(imm) = imm {
            self.feed(
                to,
                Input::Landed {
                    peer: from,
                    region: dst.region,
                    offset: dst.offset,
                    len,
                    imm,
                },
            )?;
        }
        // The writer learns of the placement one latency later.
        let at = self.now + self.cfg.latency_ns;
        self.at(at, Ev::Input(from, Input::Done { token }));
        Ok(())
    }

    /// The crash fault strikes worker `r` at an iteration boundary, once its
    /// last iteration synced; it may come back later.
    fn on_crash(&mut self, r: u32) -> Result<(), SimError> {
        let w = self.ranks[r as usize].worker.as_ref().expect("a worker");
        let nl = self.cfg.book.layers().len() as u32;
        let busy = (0..nl).any(|l| self.ranks[r as usize].node.is_in_flight(l));
        if self.dead(r) || w.phase == Phase::Done {
            return Ok(());
        }
        if busy {
            // Its last iteration is still syncing: crash once it is.
            let at = self.now + 10_000;
            self.at(at, Ev::Crash(r));
            return Ok(());
        }
        self.crashed_at = Some(w.iter);
        self.handle(Ev::Kill(r))?;
        if let Some(after) = self.cfg.faults.rejoin_after_ns {
            let after = after.max(2 * self.cfg.faults.detect_ns + 1_000_000);
            let at = self.now + after;
            self.at(at, Ev::Rejoin(r));
        }
        Ok(())
    }

    /// Rank `r` dies: its peers see their connections to it fail `detect_ns` later.
    fn on_kill(&mut self, r: u32) {
        if !self.ranks[r as usize].dead {
            self.ranks[r as usize].dead = true;
            self.settle(r);
        }
        self.cpu_kill(r);
        let detect = self.now + self.cfg.faults.detect_ns;
        for p in 0..self.ranks.len() as u32 {
            if p != r {
                self.at(
                    detect,
                    Ev::Input(
                        p,
                        Input::Closed {
                            peer: r,
                            error: Some(format!("connection reset: rank {r} died")),
                        },
                    ),
                );
            }
        }
    }

    /// A delivery, in per-connection order of its class. `from_net`: it
    /// went through the NIC queues (rather than the control shortcut).
    pub(crate) fn arrival(&mut self, at: u64, ev: Ev, from_net: bool) {
        let world = self.ranks.len();
        let mut at = at;
        let key = match &ev {
            Ev::WriteArrive { from, to, .. } => (*from as usize * world + *to as usize) * 2,
            Ev::MsgArrive { from, to, tag, .. } => {
                let c = *from as usize * world + *to as usize;
                if from_net {
                    self.msgs_in_net[c] -= 1;
                }
                let decide = matches!(
                    tidewire_engine::wire::kind_of(*tag),
                    Ok(tidewire_engine::wire::Kind::Decide)
                );
                if decide && self.cfg.decide_seed.is_some() {
                    // Random decisions also travel late, by up to 3 ms (still in
                    // order on their connection): writes sent after them, such as
                    // worker 0's values for a switch back to the PS, overtake them.
                    at += self.rand() % 3_000_000;
                }
                c * 2 + 1
            }
            Ev::Fin { from, to } => {
                // After every write and message on the connection.
                self.fins_in_net -= 1;
                let c = *from as usize * world + *to as usize;
                let at = at.max(self.order[c * 2]).max(self.order[c * 2 + 1]);
                self.order[c * 2 + 1] = at;
                self.at(at, ev);
                return;
            }
            _ => {
                self.at(at, ev);
                return;
            }
        };
        let at = at.max(self.order[key]);
        self.order[key] = at;
        self.at(at, ev);
    }
}
